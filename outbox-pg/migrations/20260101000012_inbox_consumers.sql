-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- Where each consumer of this inbox stands on its stream.
--
-- The inbox recognises an event only while its row is kept (the retention
-- window, 14 days by default). A JetStream durable that is created again (an
-- operator deleted it, or a new deployment changed its name) would otherwise
-- deliver the whole stream, and every event older than the window would be
-- applied a second time. So the consumer runtime records here, for each
-- consumer, the stream it reads, its filter subjects and its ack floor (every
-- message at or below that stream sequence was acked: applied, or
-- dead-lettered), read from JetStream every few seconds; a durable it has to
-- create again starts after that position, and a new name for the same
-- stream and subjects starts where the consumer it replaces stopped
-- (inbox_consumer::runtime, "Where a durable starts"). A consumer whose name
-- is still in use (a runtime wrote its row in the last 30 s and did not stop)
-- is another consumer, never one a new name replaces: stopped_at is set when
-- a runtime stops, cleared while one runs.
create table if not exists inbox_consumers (
  consumer        text        primary key,
  stream          text        not null,
  filter_subjects text[]      not null default '{}',
  ack_floor       bigint      not null default 0 check (ack_floor >= 0),
  created_at      timestamptz not null default now(),
  updated_at      timestamptz not null default now(),
  stopped_at      timestamptz null
);
