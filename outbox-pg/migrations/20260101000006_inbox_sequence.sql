-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- Per-subject order without clocks. The relay stamps every event with the
-- CloudEvents `sequence` extension: its outbox row's insert-order number
-- (outbox_events.seq, one counter per outbox database). The inbox keeps it so
-- that SkipStale tells an older event from a newer one by that number rather
-- than by the producer's wall clock, where one event stamped in the future
-- would make every later event of its subject look stale.
--
-- Null for an event without a sequence (published before the relay sent one,
-- or by another producer); those keep the comparison by event_time. A sequence
-- is unsigned: the check keeps a row written by hand from holding a value no
-- event can carry. Adding a nullable column without a default rewrites
-- nothing; the check and the index below each scan the table once, under the
-- lock this migration holds until it commits (short on a pruned inbox).
do $$
begin
  if not exists (select from information_schema.columns
                  where table_schema = current_schema()
                    and table_name = 'inbox_events'
                    and column_name = 'sequence') then
    alter table inbox_events
      add column sequence bigint null check (sequence >= 0);
  end if;

  -- "The highest sequence applied for this subject" for SkipStale. Partial,
  -- because that question never reads a row without a sequence.
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'inbox_events_subject_sequence_idx') then
    create index inbox_events_subject_sequence_idx
      on inbox_events (consumer, subject, sequence desc)
      where sequence is not null;
  end if;
end
$$;
