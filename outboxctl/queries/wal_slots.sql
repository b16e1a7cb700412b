-- The logical replication slots of this database (a WAL relay's among them,
-- `outbox_relay_<database>_<schema>` unless named with --wal-slot): who reads
-- each, whether its WAL is still there, and how far behind it is.
select slot_name::text as "slot!",
       plugin::text as "plugin?",
       active as "active!",
       active_pid as "active_pid?",
       wal_status as "wal_status?",
       confirmed_flush_lsn::text as "confirmed_flush_lsn?",
       case when pg_is_in_recovery() then null
            else (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint end as "lag_bytes?"
  from pg_replication_slots
 where slot_type = 'logical'
   and database = current_database()
 order by slot_name
