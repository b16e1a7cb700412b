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
alter table inbox_events
  add column if not exists sequence bigint null check (sequence >= 0);

-- "The highest sequence applied for this subject" for SkipStale. Partial,
-- because that question never reads a row without a sequence.
create index if not exists inbox_events_subject_sequence_idx
  on inbox_events (consumer, subject, sequence desc)
  where sequence is not null;
