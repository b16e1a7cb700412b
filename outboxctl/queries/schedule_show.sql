-- `outboxctl schedule show <id>`: one row, every column that says where it
-- is in its schedule, with the times from now by the database's clock.
--   $1 id; $2 max attempts
select id as "id!", event_type as "event_type!", source as "source!", subject as "subject!",
       case when isfinite(created_at) then created_at end as "created_at?",
       due_at is not null as "scheduled!",
       case when isfinite(due_at) then due_at end as "due_at?",
       case when isfinite(released_at) then released_at end as "released_at?",
       case when isfinite(cancelled_at) then cancelled_at end as "cancelled_at?",
       cancelled_by as "cancelled_by?",
       case when isfinite(published_at) then published_at end as "published_at?",
       published_stream as "published_stream?", published_seq as "published_seq?",
       attempts as "attempts!", last_error as "last_error?",
       case when isfinite(next_attempt_at) then next_attempt_at end as "next_attempt_at?",
       case when isfinite(locked_until) then locked_until end as "locked_until?",
       case when isfinite(skipped_at) then skipped_at end as "skipped_at?",
       skipped_by as "skipped_by?", skip_reason as "skip_reason?",
       case when isfinite(due_at) then extract(epoch from due_at - now()) end::float8
         as "due_in_secs?",
       case when isfinite(next_attempt_at) then extract(epoch from next_attempt_at - now()) end::float8
         as "next_in_secs?",
       coalesce(due_at <= now(), false) as "fallen_due!",
       released_at is not null as "released!",
       cancelled_at is not null as "cancelled!",
       published_at is not null as "published!",
       skipped_at is not null as "skipped!",
       coalesce(attempts >= $2 or not isfinite(next_attempt_at), false) as "parked!"
  from outbox_events
 where id = $1::uuid
