-- Replication slot $1 as the server sees it: its plugin and database, whether
-- WAL it needs was removed (wal_status 'lost', after max_slot_wal_keep_size),
-- who reads it, its confirmed position (bytes from 0/0), and how far that is
-- behind the WAL, in bytes.
select plugin::text as "plugin?",
       database::text as "database?",
       wal_status as "wal_status?",
       active_pid as "active_pid?",
       (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint as "confirmed?",
       case when pg_is_in_recovery() then null
            else (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint end as "lag_bytes?"
  from pg_replication_slots
 where slot_name = $1
