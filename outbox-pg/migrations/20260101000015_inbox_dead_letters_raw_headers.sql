-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- The header block of a dead letter as the stream stored it, byte for byte,
-- when it is one no NATS client of the runtime can read (reason
-- undecodable_headers: a line without a colon, a bare LF, bytes that are not
-- UTF-8, a status line). `headers` keeps the lines that could be read; this
-- keeps the rest. Null for every other dead letter, whose headers are whole
-- in `headers`. Nullable without a default: adding it rewrites nothing.
alter table inbox_dead_letters
  add column if not exists raw_headers bytea null;
