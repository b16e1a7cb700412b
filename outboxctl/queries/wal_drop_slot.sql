-- Drops slot $1 of this database if no one reads it: true when dropped,
-- false when it is in use, null when there is no such slot.
select case when s.active then false
            else (select true from pg_drop_replication_slot(s.slot_name)) end as "dropped?"
  from pg_replication_slots s
 where s.slot_name = $1
   and s.database = current_database()
