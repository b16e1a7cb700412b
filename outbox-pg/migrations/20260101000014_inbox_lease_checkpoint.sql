-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- The takeover checkpoint of an ordered consumer (inbox_consumer::runtime,
-- "Takeover"). A new leader looks, in the stream, for the events earlier
-- leaders left unfinished; from the ack floor on, that can be all traffic
-- since one message was left unacked. So each leader records here, about once
-- a second, the stream sequence at or below which every message it has to
-- handle is finished (applied, dead-lettered, or acked without an effect),
-- except the short list of stream sequences in checkpoint_pending; the next
-- leader reads the stream from there, and that list. Null: none recorded yet
-- (the next leader starts from the ack floor).
alter table inbox_leases
  add column if not exists checkpoint_seq bigint check (checkpoint_seq >= 0),
  add column if not exists checkpoint_pending bigint[] not null default '{}';
