-- `outboxctl stuck`: how many rows are stuck: unpublished, not skipped, and
-- failing (attempts > 0) or parked ('infinity'), in either lane that holds
-- failed rows: the retry lane (immediate rows, due_at null:
-- outbox_events_retry_idx) and the due lane (scheduled rows fallen due and
-- not cancelled: outbox_events_due_idx). A scheduled row waiting for its time
-- is never stuck.
--   $1 subject or null, $2 event type or null
select (select count(*)
          from outbox_events
         where published_at is null
           and next_attempt_at is not null
           and due_at is null
           and skipped_at is null
           and (attempts > 0 or not isfinite(next_attempt_at))
           and ($1::text is null or subject = $1::text)
           and ($2::text is null or event_type = $2::text))
     + (select count(*)
          from outbox_events
         where published_at is null
           and due_at is not null
           and cancelled_at is null
           and due_at <= now()
           and skipped_at is null
           and (attempts > 0 or not isfinite(next_attempt_at))
           and ($1::text is null or subject = $1::text)
           and ($2::text is null or event_type = $2::text)) as "count!"
