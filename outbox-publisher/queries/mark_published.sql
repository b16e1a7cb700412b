-- Set from the JetStream PubAck only, with the ack's position (the stream and
-- sequence the broker stored the message at; for a duplicate ack, those of the
-- message already stored under the id). $1 ids, $2 streams, $3 sequences,
-- element by element; a NULL stream or sequence (a sink that reports no
-- position) leaves the row without one.
--
-- "Not marked yet" is asked in a form no index predicate matches
-- (`case … then true end`, true exactly when `published_at is null`). Asked
-- plainly, after a burst of writes the statistics had not caught up with
-- (they still counted a few unpublished rows), the planner read every
-- unpublished row through `outbox_events_unpublished_idx` for each mark:
-- 280 ms to mark 1,000 of 300,000 unpublished rows (21 ms now), a cost that
-- grew with the backlog a relay was catching up on. The join stays a plain
-- `e.id = p.id`: a form the planner can only look up row by row
-- (`e.id = any(array[p.id])`) let a plan cached while the table was small
-- scan the whole table once per id (18 s to mark 5,700 rows beside 16
-- busy writers).
update outbox_events e
   set published_at = now(), next_attempt_at = null, last_error = null,
       published_stream = p.stream, published_seq = p.seq
  from unnest($1::uuid[], $2::text[], $3::bigint[]) as p(id, stream, seq)
 where e.id = p.id
   and case when e.published_at is null then true end
