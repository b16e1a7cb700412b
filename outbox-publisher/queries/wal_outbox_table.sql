-- The schema holding the outbox table the session finds (the first of its
-- search_path that has one) and the database: the WAL source names its slot
-- and publication after both, so outboxes in other schemas or databases of
-- one cluster never share a slot.
select n.nspname::text as "schema!", current_database()::text as "database!"
  from pg_class c
  join pg_namespace n on n.oid = c.relnamespace
 where c.oid = to_regclass('outbox_events')
