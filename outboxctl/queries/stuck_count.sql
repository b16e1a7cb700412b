-- `outboxctl stuck`: how many rows are stuck: unpublished, not skipped, in the
-- retry lane, and failing (attempts > 0) or parked ('infinity').
--   $1 subject or null, $2 event type or null
select count(*) as "count!"
  from outbox_events
 where published_at is null
   and skipped_at is null
   and next_attempt_at is not null
   and (attempts > 0 or not isfinite(next_attempt_at))
   and ($1::text is null or subject = $1::text)
   and ($2::text is null or event_type = $2::text)
