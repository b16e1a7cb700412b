-- Set from the JetStream PubAck only, with the ack's position (the stream and
-- sequence the broker stored the message at; for a duplicate ack, those of the
-- message already stored under the id). $1 ids, $2 streams, $3 sequences,
-- element by element; a NULL stream or sequence (a sink that reports no
-- position) leaves the row without one.
update outbox_events e
   set published_at = now(), next_attempt_at = null, last_error = null,
       published_stream = p.stream, published_seq = p.seq
  from unnest($1::uuid[], $2::text[], $3::bigint[]) as p(id, stream, seq)
 where e.id = p.id
   and e.published_at is null
