-- The audit found a published row's message gone from its stream position (or
-- another message there): it becomes unpublished again, in the retry lane and
-- due now, so the relay that owns its shard publishes it again with the same
-- id. Not the main lane: the shard's cursor is past this row already, and a
-- row put back there would never be read again. Guarded by the position found
-- missing, so a row published again meanwhile (or put back by another audit)
-- is left alone. $1 id, $2 stream, $3 sequence, $4 last_error.
update outbox_events
   set published_at = null, published_stream = null, published_seq = null,
       next_attempt_at = now(), last_error = $4
 where id = $1
   and published_at is not null
   and published_stream = $2
   and published_seq = $3
