-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- What the WAL source (outbox-relay --source wal) knows of its replication
-- slot, kept beside the outbox so that it outlives any relay process.
--
-- A slot streams the rows committed after it was made, never those before.
-- So a relay that makes a slot first publishes, through the polling path,
-- every row up to the highest seq handed out once the slot exists (the
-- backfill), and only then reads the WAL, skipping rows at or below that
-- seq (the floor). Once that backfill is done the relay records it here.
-- A relay that later takes the lead of an intact slot with a record (a
-- restart, a takeover, a deploy) reads on from the slot's confirmed position
-- at the WAL's speed: every row it lacks is in the slot's stream. Without a
-- record (the backfill was cut short, or an older relay made the slot) it
-- backfills again. The relay deletes the record before it makes the slot
-- (again), so a record never outlives the slot it speaks of.
--
-- slot_name: the replication slot's name.
-- floor: rows at or below this seq were published by the backfill.
-- backfilled_at: when the backfill was done.
create table if not exists outbox_relay_slots (
  slot_name     text        primary key,
  floor         bigint      not null,
  backfilled_at timestamptz not null default now()
);
