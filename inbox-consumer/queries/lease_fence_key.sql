-- The two keys of one consumer's leadership fence (see lease_fence_shared.sql),
-- read once by a new leader and used for its tenure: computed per transaction,
-- the schema lookup made PostgreSQL plan a catalog join at every commit.
-- The first key names the schema holding the inbox (nothing for `public`,
-- `:<schema>` otherwise; see outbox_pg::Namespace), so consumers of inboxes
-- in other schemas of the database, even under the same name, never meet.
select hashtext(
         'inbox_consumer.fence'
         || coalesce((select case when n.nspname = 'public' then '' else ':' || n.nspname end
                        from pg_class c
                        join pg_namespace n on n.oid = c.relnamespace
                       where c.oid = to_regclass('inbox_events')), '')) as "schema!",
       hashtext($1) as "name!"
