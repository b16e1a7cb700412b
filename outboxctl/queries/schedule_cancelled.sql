-- `outboxctl schedule cancel`: the row as the cancel left it, in the cancel's
-- transaction: whether this cancel set cancelled_at (to the transaction's
-- now()) or an earlier one had, and, for a cancel that came too late, why.
--   $1 id
select case when isfinite(due_at) then due_at end as "due_at?",
       case when isfinite(cancelled_at) then cancelled_at end as "cancelled_at?",
       cancelled_by as "cancelled_by?",
       coalesce(cancelled_at = now(), false) as "by_this!",
       due_at is not null as "scheduled!",
       case when isfinite(released_at) then released_at end as "released_at?",
       case when isfinite(published_at) then published_at end as "published_at?"
  from outbox_events
 where id = $1::uuid
