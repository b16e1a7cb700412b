-- `outboxctl skip <id>`: the row, locked until the skip commits, and the
-- database role doing it. A scheduled row no relay has taken yet, or one
-- cancelled, is not skipped: a cancel is what keeps it from being published.
--   $1 id
select id as "id!", subject as "subject!", seq as "seq!",
       published_at as "published_at?",
       skipped_at as "skipped_at?", skipped_by as "skipped_by?", skip_reason as "skip_reason?",
       case when isfinite(cancelled_at) then cancelled_at end as "cancelled_at?",
       cancelled_by as "cancelled_by?",
       due_at is not null and released_at is null as "unreleased_schedule!",
       current_user::text as "role!"
  from outbox_events
 where id = $1::uuid
   for update
