-- Serialises the transactions of one consumer on one subject, across every
-- replica, until commit or rollback. A transaction-scoped advisory lock in its
-- own two-key space (class `inbox_consumer.subject`), so it never meets an
-- application's single-key advisory locks. A hash collision only serialises
-- two unrelated subjects.
-- The first key names the schema holding the inbox (nothing for `public`,
-- `:<schema>` otherwise; see outbox_pg::Namespace), so consumers of inboxes
-- in other schemas of the database, even under the same name, never meet.
select pg_advisory_xact_lock(hashtext(
         'inbox_consumer.subject'
         || coalesce((select case when n.nspname = 'public' then '' else ':' || n.nspname end
                        from pg_class c
                        join pg_namespace n on n.oid = c.relnamespace
                       where c.oid = to_regclass('inbox_events')), '')),
        hashtext($1 || '/' || $2))
