-- Set from the JetStream PubAck only, with the ack's position (the stream and
-- sequence the broker stored the message at; for a duplicate ack, those of the
-- message already stored under the id). $1 ids, $2 streams, $3 sequences,
-- element by element; a NULL stream or sequence (a sink that reports no
-- position) leaves the row without one.
--
-- The rows are found by their ids alone (`e.id = any($1)`: the primary key),
-- whatever the statistics say. "Not marked yet" is asked in a form no index
-- predicate matches (`case … then true end`, true exactly when
-- `published_at is null`): written plainly, the planner may read every
-- unpublished row through `outbox_events_unpublished_idx` for each mark, and
-- does so after a burst of writes the statistics have not caught up with
-- (they still count a few unpublished rows): 280 ms to mark 1,000 of
-- 300,000 unpublished rows instead of 16 ms, a cost that grows with the
-- backlog a relay is catching up on.
update outbox_events e
   set published_at = now(), next_attempt_at = null, last_error = null,
       published_stream = p.stream, published_seq = p.seq
  from unnest($1::uuid[], $2::text[], $3::bigint[]) as p(id, stream, seq)
 where e.id = p.id
   and e.id = any($1::uuid[])
   and case when e.published_at is null then true end
