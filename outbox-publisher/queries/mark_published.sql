-- Set from the JetStream PubAck only, with the ack's position (the stream and
-- sequence the broker stored the message at; for a duplicate ack, those of the
-- message already stored under the id). $1 ids, $2 streams, $3 sequences,
-- element by element; a NULL stream or sequence (a sink that reports no
-- position) leaves the row without one.
--
-- Each row is found through the primary key, one lookup per id, whatever
-- the statistics say:
-- - "Not marked yet" is asked in a form no index predicate matches
--   (`case … then true end`, true exactly when `published_at is null`).
--   Asked plainly, after a burst of writes the statistics had not caught up
--   with (they still counted a few unpublished rows), the planner read every
--   unpublished row through `outbox_events_unpublished_idx` for each mark:
--   280 ms to mark 1,000 of 300,000 unpublished rows, a cost that grew with
--   the backlog a relay was catching up on.
-- - `e.id = any(array[p.id])`, not `e.id = p.id`: the planner cannot hash or
--   merge on it, only look each id up (on `=` it hashed the ids against a
--   scan of the whole table once a mark had more than about 1 id per 100
--   rows). The relay runs it unprepared (`persistent(false)`), so it is
--   planned for the table as it is at each mark: a generic plan cached while
--   the table was small scans the table once per id (18 s to mark 5,700 rows
--   beside 16 busy writers).
update outbox_events e
   set published_at = now(), next_attempt_at = null, last_error = null,
       published_stream = p.stream, published_seq = p.seq
  from unnest($1::uuid[], $2::text[], $3::bigint[]) as p(id, stream, seq)
 where e.id = any(array[p.id])
   and case when e.published_at is null then true end
