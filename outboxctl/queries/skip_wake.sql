-- `outboxctl skip <id>`: the rows of its subject deferred behind it (never
-- failed themselves) become due now, so a running relay publishes them at
-- once (as the relay's wake_followers.sql does after a publish). Scheduled
-- rows are not followers (the due lane holds them to their time).
-- Found through outbox_events_retry_subject_idx: by the subject's hash, then
-- the subject itself.
--   $1 subject, $2 the skipped row's seq
update outbox_events
   set next_attempt_at = now()
 where hashtextextended(subject, 0) = hashtextextended($1::text, 0)
   and subject = $1::text
   and seq > $2::bigint
   and published_at is null
   and next_attempt_at > now()
   and due_at is null
   and skipped_at is null
   and attempts = 0
returning id as "id!"
