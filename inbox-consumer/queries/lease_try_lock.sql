-- Leadership of one consumer: a session-level advisory lock in its own two-key
-- space. The server releases it when the holder's session ends (the process
-- died, or stayed silent past idle_session_timeout), which is the failover.
-- The first key names the schema holding the inbox (nothing for `public`,
-- `:<schema>` otherwise; see outbox_pg::Namespace), so consumers of inboxes
-- in other schemas of the database, even under the same name, never meet.
select pg_try_advisory_lock(hashtext(
         'inbox_consumer.leader'
         || coalesce((select case when n.nspname = 'public' then '' else ':' || n.nspname end
                        from pg_class c
                        join pg_namespace n on n.oid = c.relnamespace
                       where c.oid = to_regclass('inbox_events')), '')),
        hashtext($1)) as "locked!"
