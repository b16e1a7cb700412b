-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- One wake-up channel per outbox. Several outboxes may live in one database,
-- one per schema (a tenant each, with its own relays): each relay listens on
-- the channel of its own table's schema, so a commit in one outbox never
-- wakes the relays of another. The table in `public` keeps the channel it
-- always had, `outbox_events`; a table in schema S notifies
-- `outbox_events.S`, or, when that is longer than a channel name may be (63
-- bytes), `outbox_events.` and the hex of hashtextextended(S, 0). The relay
-- computes the same name (outbox_pg::Namespace::notify_channel); both sides
-- are tested to agree.
create or replace function outbox_events_notify() returns trigger
language plpgsql as $$
begin
  perform pg_notify(
    case when TG_TABLE_SCHEMA = 'public' then 'outbox_events'
         when octet_length('outbox_events.' || TG_TABLE_SCHEMA) <= 63
           then 'outbox_events.' || TG_TABLE_SCHEMA
         else 'outbox_events.' || to_hex(hashtextextended(TG_TABLE_SCHEMA, 0))
    end,
    '');
  return null;
end;
$$;
