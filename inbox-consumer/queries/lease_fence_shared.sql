-- The fence of one consumer's leadership. A handler transaction takes it shared
-- just before it reads the epoch and commits; a new leader takes it exclusive
-- while it bumps the epoch. So a new epoch waits for the commits already past
-- their check, and every check after it sees the new epoch.
-- The first key names the schema holding the inbox (nothing for `public`,
-- `:<schema>` otherwise; see outbox_pg::Namespace), so consumers of inboxes
-- in other schemas of the database, even under the same name, never meet.
select pg_advisory_xact_lock_shared(hashtext(
         'inbox_consumer.fence'
         || coalesce((select case when n.nspname = 'public' then '' else ':' || n.nspname end
                        from pg_class c
                        join pg_namespace n on n.oid = c.relnamespace
                       where c.oid = to_regclass('inbox_events')), '')),
        hashtext($1))
