-- Set from the JetStream PubAck only. $1 ids.
update outbox_events
   set published_at = now(), next_attempt_at = null, last_error = null
 where id = any($1::uuid[])
   and published_at is null
