-- What the WAL source needs of the server and the role: wal_level logical,
-- the REPLICATION attribute (or superuser) for the replication connection and
-- for creating the slot, and a free replication slot.
select current_setting('wal_level') as "wal_level!",
       current_user::text as "role!",
       coalesce((select rolreplication or rolsuper from pg_roles where rolname = current_user), false)
         as "can_replicate!",
       current_setting('max_replication_slots')::int
         - (select count(*) from pg_replication_slots)::int as "free_slots!"
