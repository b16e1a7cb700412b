-- The namespace of the outbox whose table `$1` (outbox_events, or an inbox
-- table) the search_path leads to: the schema that holds it, and what relays
-- coordinate on in it. Nothing when the table is not found (not migrated, or
-- not on the search_path).
--   $1 table name; $2, $3 the relays' member and shard lock keys of the
--   outbox in `public`, kept from before outboxes were namespaced.
-- The channels are the ones the insert triggers notify on (migrations
-- 20260101000011 and 20260101000016): both sides must say the same.
select n.nspname::text as "schema!",
       case when n.nspname = 'public' then $2::int
            else hashtext('outbox_relay.members:' || n.nspname) end as "members_key!",
       case when n.nspname = 'public' then $3::int
            else hashtext('outbox_relay.shards:' || n.nspname) end as "shards_key!",
       case when n.nspname = 'public' then 'outbox_events'
            when octet_length('outbox_events.' || n.nspname) <= 63
              then 'outbox_events.' || n.nspname
            else 'outbox_events.' || to_hex(hashtextextended(n.nspname, 0))
       end as "channel!",
       case when n.nspname = 'public' then 'outbox_events_due'
            when octet_length('outbox_events_due.' || n.nspname) <= 63
              then 'outbox_events_due.' || n.nspname
            else 'outbox_events_due.' || to_hex(hashtextextended(n.nspname, 0))
       end as "due_channel!"
  from pg_class c
  join pg_namespace n on n.oid = c.relnamespace
 where c.oid = to_regclass($1)
