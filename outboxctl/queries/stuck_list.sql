-- `outboxctl stuck`: the stuck rows (as stuck_count.sql), oldest first, with
-- their state: parked (past the cap: attempts >= $1 or due at 'infinity'),
-- deferred (behind an earlier failing row of its subject), or backoff (due at
-- next_attempt_at).
--   $1 max attempts, $2 subject or null, $3 event type or null, $4 limit
select e.id as "id!", e.subject as "subject!", e.event_type as "event_type!",
       e.attempts as "attempts!", e.last_error as "last_error?",
       case when isfinite(e.created_at) then e.created_at end as "created_at?",
       case when isfinite(e.next_attempt_at) then e.next_attempt_at end as "next_attempt_at?",
       case when e.attempts >= $1 or not isfinite(e.next_attempt_at) then 'parked'
            when exists (select 1
                           from outbox_events b
                          where hashtextextended(b.subject, 0) = hashtextextended(e.subject, 0)
                            and b.subject = e.subject
                            and b.published_at is null
                            and b.next_attempt_at is not null
                            and b.skipped_at is null
                            and b.seq < e.seq
                            and (b.attempts > 0 or not isfinite(b.next_attempt_at))) then 'deferred'
            else 'backoff' end as "state!"
  from outbox_events e
 where e.published_at is null
   and e.skipped_at is null
   and e.next_attempt_at is not null
   and (e.attempts > 0 or not isfinite(e.next_attempt_at))
   and ($2::text is null or e.subject = $2::text)
   and ($3::text is null or e.event_type = $3::text)
 order by e.created_at, e.seq
 limit $4
