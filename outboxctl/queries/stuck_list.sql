-- `outboxctl stuck`: the stuck rows (as stuck_count.sql), oldest first, with
-- their state: parked (past the cap: attempts >= $1 or due at 'infinity'),
-- deferred (an immediate row behind an earlier failing row of its subject),
-- or backoff (due at next_attempt_at). A scheduled row (due_at set; it fell
-- due and failed) is never deferred: it is outside its entity's order.
--   $1 max attempts, $2 subject or null, $3 event type or null, $4 limit
with stuck as (
  select e.id, e.seq, e.subject, e.event_type, e.attempts, e.last_error, e.created_at,
         e.next_attempt_at, e.due_at
    from outbox_events e
   where e.published_at is null
     and e.next_attempt_at is not null
     and e.due_at is null
     and e.skipped_at is null
     and (e.attempts > 0 or not isfinite(e.next_attempt_at))
     and ($2::text is null or e.subject = $2::text)
     and ($3::text is null or e.event_type = $3::text)
  union all
  select e.id, e.seq, e.subject, e.event_type, e.attempts, e.last_error, e.created_at,
         e.next_attempt_at, e.due_at
    from outbox_events e
   where e.published_at is null
     and e.due_at is not null
     and e.cancelled_at is null
     and e.due_at <= now()
     and e.skipped_at is null
     and (e.attempts > 0 or not isfinite(e.next_attempt_at))
     and ($2::text is null or e.subject = $2::text)
     and ($3::text is null or e.event_type = $3::text)
)
select e.id as "id!", e.subject as "subject!", e.event_type as "event_type!",
       e.attempts as "attempts!", e.last_error as "last_error?",
       case when isfinite(e.created_at) then e.created_at end as "created_at?",
       case when isfinite(e.next_attempt_at) then e.next_attempt_at end as "next_attempt_at?",
       case when isfinite(e.due_at) then e.due_at end as "due_at?",
       case when e.attempts >= $1 or not isfinite(e.next_attempt_at) then 'parked'
            when e.due_at is null
             and exists (select 1
                           from outbox_events b
                          where hashtextextended(b.subject, 0) = hashtextextended(e.subject, 0)
                            and b.subject = e.subject
                            and b.published_at is null
                            and b.next_attempt_at is not null
                            and b.due_at is null
                            and b.skipped_at is null
                            and b.seq < e.seq
                            and (b.attempts > 0 or not isfinite(b.next_attempt_at))) then 'deferred'
            else 'backoff' end as "state!"
  from stuck e
 order by e.created_at, e.seq
 limit $4
