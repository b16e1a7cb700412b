-- `outboxctl retry --all-stuck`: every stuck row (as stuck_count.sql: failing
-- or parked, immediate rows of the retry lane and scheduled rows fallen due)
-- becomes claimable now. Rows deferred behind them follow when they are
-- published. A scheduled row waiting for its time is not stuck, and not
-- touched.
with stuck as (
  select id
    from outbox_events
   where published_at is null
     and next_attempt_at is not null
     and due_at is null
     and skipped_at is null
     and (attempts > 0 or not isfinite(next_attempt_at))
  union all
  select id
    from outbox_events
   where published_at is null
     and due_at is not null
     and cancelled_at is null
     and due_at <= now()
     and skipped_at is null
     and (attempts > 0 or not isfinite(next_attempt_at))
)
update outbox_events o
   set next_attempt_at = now(), attempts = 0
  from stuck s
 where o.id = s.id
returning o.id as "id!"
