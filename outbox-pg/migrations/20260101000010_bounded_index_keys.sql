-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- Index entries of a bounded size, whatever a writer puts in a column.
--
-- A btree entry holds at most about a third of a page (2,704 bytes with 8 KiB
-- pages); an insert or update whose entry is larger fails. outbox_events'
-- text columns have no length limit, and any SQL client may write them, so no
-- index of this table may hold one of them as it is. The only one that did is
-- outbox_events_retry_subject_idx on (subject, seq): a row entered it when it
-- failed, was deferred, parked or skipped, so a row whose subject was a few
-- thousand characters long could not be marked at all, and its relay retried
-- the same failing statement every batch.
--
-- The index keeps its name and its rows (the retry lane) and holds the
-- subject's 64-bit hash instead (hashtextextended, the hash the shard column
-- is computed with): 8 bytes for any subject. Queries that look a subject up
-- in the retry lane compare the hashes, which the index answers, and then the
-- subjects themselves, so a hash collision costs a row read, never a wrong
-- answer.
--
-- Only when the index still has the old definition: run again, or after
-- 20260101000005 was run again (which finds the index by its name and leaves
-- it), this changes nothing. The index is partial (rows in the retry lane
-- only), so building it reads the table once and writes few entries.
--
-- The inbox's indexes on subject, (consumer, subject, event_time) and
-- (consumer, subject, sequence), keep their definitions: the consumer runtime
-- writes an inbox row only for an envelope it decoded, whose subject is at
-- most 1,024 bytes (outbox_pg::MAX_ATTRIBUTE_LEN; a longer one is a dead
-- letter), and a consumer's name is a JetStream durable name, at most 255
-- bytes, so their entries stay far below the limit. inbox_dead_letters
-- indexes no text of a message.
do $$
begin
  if exists (select from pg_indexes
              where schemaname = current_schema()
                and indexname = 'outbox_events_retry_subject_idx'
                and indexdef not like '%hashtextextended(subject, %') then
    drop index outbox_events_retry_subject_idx;
  end if;

  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_retry_subject_idx') then
    create index outbox_events_retry_subject_idx
      on outbox_events (hashtextextended(subject, 0), seq)
      where published_at is null and next_attempt_at is not null;
  end if;
end
$$;
