select current_database() as "name!"
