-- `outboxctl retry <id>…`: the rows named, to check each before changing any:
-- published, skipped or cancelled (refused), in the main lane (claimable
-- already), or scheduled and waiting for its time (left as it is).
--   $1 ids
select id as "id!",
       published_at as "published_at?",
       skipped_at as "skipped_at?", skipped_by as "skipped_by?",
       case when isfinite(cancelled_at) then cancelled_at end as "cancelled_at?",
       cancelled_by as "cancelled_by?",
       next_attempt_at is null as "main_lane!",
       case when due_at > now() and released_at is null and isfinite(due_at) then due_at end
         as "waiting_until?",
       coalesce(due_at > now() and released_at is null, false) as "waiting!"
  from outbox_events
 where id = any($1::uuid[])
