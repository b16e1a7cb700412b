-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- Scheduled events: rows published at (or after) a time of the writer's
-- choosing, and cancelled in a transaction of the writer's own. The
-- contract's columns are untouched; these are extensions.
--
-- due_at: the earliest time, by the database's clock, the row may be
--   published. Set by the writer at insert (Outbox::schedule, or plain SQL);
--   null is an immediate event. A due time not after the inserting
--   transaction's start (now()) is no schedule: the trigger below clears it,
--   and the row is an immediate event in its entity's order.
-- released_at: when a relay took the row, fallen due, for publishing. From
--   then on a cancel answers "already published": the row will be published
--   (at least once), whatever happens to that relay.
-- cancelled_at, cancelled_by: when and by whom (the database role, or what
--   the canceller names) a scheduled row was cancelled before its release.
--   A cancelled row is never published; it is kept as the record (published_at
--   stays null) and deleted by retention once cancelled longer ago than the
--   window.
--
-- The lanes. A scheduled row waits in the *due lane*, neither in the main
-- lane (the trigger sets next_attempt_at to its due time at insert) nor in
-- the retry lane (whose indexes and queries now take rows with no due time
-- only): so it is never published early by the polling or WAL paths, never
-- blocks nor waits behind its entity's immediate rows, and a million of
-- them cost those paths nothing (their indexes do not hold them). The relay's
-- due lane reads outbox_events_due_idx up to now() and no further, and sleeps
-- until the next due time, woken by outbox_events_notify_due when a nearer
-- one commits. A scheduled row that fails is backed off in the due lane.
--
-- Every column is nullable, so adding them rewrites nothing and holds the
-- table's lock only for the catalog change. The retry lane's indexes are
-- rebuilt once (they are partial: the build reads the table and writes few
-- entries).
do $$
begin
  if not exists (select from information_schema.columns
                  where table_schema = current_schema()
                    and table_name = 'outbox_events'
                    and column_name = 'due_at') then
    alter table outbox_events
      add column due_at       timestamptz null,
      add column released_at  timestamptz null,
      add column cancelled_at timestamptz null,
      add column cancelled_by text        null;
  end if;
end
$$;

-- The due time is the database's rule, whoever writes the row: at insert a
-- past one is cleared and a future one keeps the row out of the main lane;
-- afterwards no update (a retry by an operator, a follower woken, a backoff)
-- makes an unpublished scheduled row due before its time, and changing
-- due_at before the release moves the row with it.
create or replace function outbox_events_schedule() returns trigger
language plpgsql as $$
begin
  if new.published_at is not null or new.cancelled_at is not null then
    return new;
  end if;
  -- A time no message can carry (RFC 3339 years 1-9999) and no relay could
  -- ever reach is a writer's mistake, refused naming it.
  if new.due_at >= '10000-01-01 00:00:00+00' then
    raise exception 'outbox_events.due_at % is not a time an event can be due at: it must be finite and before the year 10000', new.due_at
      using errcode = '22008';
  end if;
  if tg_op = 'INSERT' then
    if new.due_at <= now() then
      new.due_at := null;
    else
      new.next_attempt_at := new.due_at;
    end if;
  elsif new.released_at is null and new.due_at is distinct from old.due_at then
    new.next_attempt_at := new.due_at;
  elsif new.next_attempt_at is null or new.next_attempt_at < new.due_at then
    new.next_attempt_at := new.due_at;
  end if;
  return new;
end;
$$;

-- A statement-level wake-up for the due lane's sleepers: one notification
-- per transaction that scheduled rows (identical notifications of one
-- transaction are folded into one), on a channel of its own so a relay's due
-- lane hears nothing of immediate rows. The channel follows the schema as
-- outbox_events_notify's does (migration 20260101000011):
-- `outbox_events_due` in public, `outbox_events_due.S` in schema S (the hex
-- of hashtextextended(S, 0) in place of S when over 63 bytes);
-- outbox_pg::Namespace::due_channel computes the same name.
create or replace function outbox_events_notify_due() returns trigger
language plpgsql as $$
begin
  perform pg_notify(
    case when TG_TABLE_SCHEMA = 'public' then 'outbox_events_due'
         when octet_length('outbox_events_due.' || TG_TABLE_SCHEMA) <= 63
           then 'outbox_events_due.' || TG_TABLE_SCHEMA
         else 'outbox_events_due.' || to_hex(hashtextextended(TG_TABLE_SCHEMA, 0))
    end,
    '');
  return null;
end;
$$;

do $$
begin
  -- Row triggers with a WHEN condition: for an immediate row the condition
  -- is false and no function runs, so the immediate path pays nothing.
  if not exists (select from pg_trigger t
                   join pg_class c on c.oid = t.tgrelid
                  where c.relnamespace = current_schema()::regnamespace
                    and c.relname = 'outbox_events'
                    and t.tgname = 'outbox_events_schedule') then
    create trigger outbox_events_schedule
      before insert or update of due_at, next_attempt_at on outbox_events
      for each row when (new.due_at is not null)
      execute function outbox_events_schedule();
  end if;

  if not exists (select from pg_trigger t
                   join pg_class c on c.oid = t.tgrelid
                  where c.relnamespace = current_schema()::regnamespace
                    and c.relname = 'outbox_events'
                    and t.tgname = 'outbox_events_notify_due') then
    create trigger outbox_events_notify_due
      after insert on outbox_events
      for each row when (new.due_at is not null)
      execute function outbox_events_notify_due();
  end if;

  -- The due lane, per shard by the time a row is next due (its due time, or
  -- its backoff after a failure), then in insert order: the relay's take
  -- reads rows due at the same time in seq order and stops after a few,
  -- however many fall due together. Cancelled rows leave it.
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_due_idx') then
    create index outbox_events_due_idx
      on outbox_events (shard, next_attempt_at, seq)
      where published_at is null and due_at is not null and cancelled_at is null;
  end if;

  -- The same rows by due time, for the gauges and operators: the rows fallen
  -- due are a range at its start, the next due time its first entry past
  -- now(), so neither reads the rows due later.
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_due_at_idx') then
    create index outbox_events_due_at_idx
      on outbox_events (due_at)
      where published_at is null and due_at is not null and cancelled_at is null;
  end if;

  -- Retention finds cancelled rows past the window without reading the
  -- unpublished ones.
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_cancelled_idx') then
    create index outbox_events_cancelled_idx
      on outbox_events (cancelled_at)
      where cancelled_at is not null and published_at is null;
  end if;

  -- The retry lane takes rows without a due time only.
  if exists (select from pg_indexes
              where schemaname = current_schema()
                and indexname = 'outbox_events_retry_idx'
                and indexdef not like '%due_at IS NULL%') then
    drop index outbox_events_retry_idx;
  end if;
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_retry_idx') then
    create index outbox_events_retry_idx
      on outbox_events (shard, next_attempt_at)
      where published_at is null and next_attempt_at is not null and due_at is null;
  end if;

  if exists (select from pg_indexes
              where schemaname = current_schema()
                and indexname = 'outbox_events_retry_subject_idx'
                and indexdef not like '%due_at IS NULL%') then
    drop index outbox_events_retry_subject_idx;
  end if;
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_retry_subject_idx') then
    create index outbox_events_retry_subject_idx
      on outbox_events (hashtextextended(subject, 0), seq)
      where published_at is null and next_attempt_at is not null and due_at is null;
  end if;
end
$$;
