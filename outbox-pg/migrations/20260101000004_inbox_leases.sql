-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- Ordered consumption (ConsumerConfig::ordered): one replica of a consumer at a
-- time is its leader and the only one that fetches. Leadership itself is a
-- session-level advisory lock (released by the server the moment the leader's
-- session ends); this row carries the fencing epoch, bumped by every new
-- leader, which each handler transaction checks just before it commits so that
-- a deposed leader's late transactions roll back instead of committing out of
-- order.
create table if not exists inbox_leases (
  consumer    text        primary key,
  epoch       bigint      not null,
  -- who took it last (host:pid), for operators
  holder      text        not null,
  acquired_at timestamptz not null default now(),
  -- whether that leader let go cleanly (drained, every message acked); if not,
  -- the next leader first waits out the pulls the last one may still have open
  released    boolean     not null default false
);
