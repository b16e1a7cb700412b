-- Which of the rows $1, read from the WAL, are still fresh: neither
-- published nor in the retry lane (no failure, deferral or skip recorded).
-- Asked once their transactions are visible (rows read again on a
-- catch-up), or once the slot is past them (the monitor's suspects), so a
-- row not returned has an outcome: published (marked), in the retry lane,
-- or published and deleted since by retention.
--
-- Found through the primary key whatever the statistics say: "fresh" is
-- asked in a form no partial index's predicate matches (`case … then true
-- end`), as in mark_published.sql. Asked plainly, with statistics that had
-- not caught up with a burst of writes, the planner read every fresh row
-- through outbox_events_shard_seq_idx for each look. The relay runs it
-- unprepared, planned for the table as it is.
select id as "id!"
  from outbox_events
 where id = any($1::uuid[])
   and case when published_at is null and next_attempt_at is null then true end
