-- The outbox table. The first nine columns are the contract and must not change;
-- the columns after them are documented extensions used by the relay.
create table if not exists outbox_events (
  id           uuid        primary key,
  event_type   text        not null,
  source       text        not null,
  subject      text        not null,
  time         timestamptz not null,
  data         jsonb       not null,
  created_at   timestamptz not null default now(),
  published_at timestamptz null,
  attempts     int         not null default 0,
  -- Extensions (all nullable, none required from a writer):
  -- the earliest time the relay may try this row again (backoff after a failure,
  -- or deferral while an earlier event of the same subject is blocked)
  next_attempt_at timestamptz null,
  -- a relay holds the row until this time while it publishes it (claim lease)
  locked_until    timestamptz null,
  -- the last publish error, for operators
  last_error      text        null,
  -- W3C trace context of the writer, sent as message headers
  traceparent     text        null,
  tracestate      text        null
);

-- The publisher's only query. Without this it is a sequential scan of every
-- event the service has ever published, forever.
create index if not exists outbox_events_unpublished_idx
  on outbox_events (created_at)
  where published_at is null;

-- Per-subject ordering: "is there an earlier unpublished event of this subject?"
create index if not exists outbox_events_subject_unpublished_idx
  on outbox_events (subject, created_at, id)
  where published_at is null;

-- Retention scans published rows by age.
create index if not exists outbox_events_published_idx
  on outbox_events (published_at)
  where published_at is not null;

-- Every publish marks a row, leaving a dead tuple and a dead index entry behind.
-- Vacuum this table early and without throttling so the claim query does not
-- wade through them.
alter table outbox_events set (
  autovacuum_vacuum_scale_factor = 0.0,
  autovacuum_vacuum_threshold = 2000,
  autovacuum_vacuum_insert_scale_factor = 0.0,
  autovacuum_vacuum_insert_threshold = 5000,
  autovacuum_analyze_scale_factor = 0.02,
  autovacuum_vacuum_cost_delay = 0,
  fillfactor = 90
);

-- Wake relays the moment an event commits (NOTIFY is delivered at commit and
-- dropped on rollback). One notification per statement, not per row.
create or replace function outbox_events_notify() returns trigger
language plpgsql as $$
begin
  perform pg_notify('outbox_events', '');
  return null;
end;
$$;

drop trigger if exists outbox_events_notify on outbox_events;
create trigger outbox_events_notify
  after insert on outbox_events
  for each statement execute function outbox_events_notify();
