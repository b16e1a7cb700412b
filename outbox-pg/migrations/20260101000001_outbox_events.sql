-- outbox-pg schema. Every file here is idempotent: run it again, by any tool
-- (outbox_pg::migrate at start-up, sqlx, Flyway, `psql --single-transaction
-- -f`), in any order with the others having run, and it changes nothing and
-- takes no lock on a table that is already in place. So each step that would
-- lock a table (an index, a column, a trigger) first checks whether it is done.
-- Names are never schema-qualified: everything is created in the first schema
-- of the session's search_path, and found there.
--
-- The migration lock (outbox_pg::MIGRATION_LOCK), held until this file's
-- transaction ends, so a tool running these files and a service starting up
-- never change the schema at the same time. Re-entrant: outbox_pg::migrate
-- holds it already on the same session.
select pg_advisory_xact_lock(1868721409, 0);

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

do $$
begin
  -- The publisher's only query. Without this it is a sequential scan of every
  -- event the service has ever published, forever.
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_unpublished_idx') then
    create index outbox_events_unpublished_idx
      on outbox_events (created_at)
      where published_at is null;
  end if;

  -- (Earlier versions of this file also built outbox_events_subject_unpublished_idx,
  -- for per-subject ordering, which 20260101000005 replaces and drops. It is
  -- no longer built here only to be dropped there.)

  -- Retention scans published rows by age.
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_published_idx') then
    create index outbox_events_published_idx
      on outbox_events (published_at)
      where published_at is not null;
  end if;

  -- Every publish marks a row, leaving a dead tuple and a dead index entry
  -- behind. Vacuum this table early and without throttling so the claim query
  -- does not wade through them. Set once, on a table without storage settings:
  -- an operator's later tuning is kept.
  if (select reloptions from pg_class
       where relnamespace = current_schema()::regnamespace
         and relname = 'outbox_events') is null then
    alter table outbox_events set (
      autovacuum_vacuum_scale_factor = 0.0,
      autovacuum_vacuum_threshold = 2000,
      autovacuum_vacuum_insert_scale_factor = 0.0,
      autovacuum_vacuum_insert_threshold = 5000,
      autovacuum_analyze_scale_factor = 0.02,
      autovacuum_vacuum_cost_delay = 0,
      fillfactor = 90
    );
  end if;
end
$$;

-- Wake relays the moment an event commits (NOTIFY is delivered at commit and
-- dropped on rollback). One notification per statement, not per row.
create or replace function outbox_events_notify() returns trigger
language plpgsql as $$
begin
  perform pg_notify('outbox_events', '');
  return null;
end;
$$;

do $$
begin
  if not exists (select from pg_trigger t
                   join pg_class c on c.oid = t.tgrelid
                  where c.relnamespace = current_schema()::regnamespace
                    and c.relname = 'outbox_events'
                    and t.tgname = 'outbox_events_notify') then
    create trigger outbox_events_notify
      after insert on outbox_events
      for each statement execute function outbox_events_notify();
  end if;
end
$$;
