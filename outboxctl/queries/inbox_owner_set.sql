-- Hands consumer $1's name to role $2.
update inbox_consumers set owner = $2 where consumer = $1
