-- Gives up leadership at a clean shutdown, once every held message is acked:
-- records that it let go cleanly, then unlocks.
with released as (
  update inbox_leases set released = true where consumer = $1 and epoch = $2
)
-- The first key names the schema holding the inbox (nothing for `public`,
-- `:<schema>` otherwise; see outbox_pg::Namespace), so consumers of inboxes
-- in other schemas of the database, even under the same name, never meet.
select pg_advisory_unlock(hashtext(
         'inbox_consumer.leader'
         || coalesce((select case when n.nspname = 'public' then '' else ':' || n.nspname end
                        from pg_class c
                        join pg_namespace n on n.oid = c.relnamespace
                       where c.oid = to_regclass('inbox_events')), '')),
        hashtext($1))
