-- `outboxctl retry --all-stuck`: every stuck row (as stuck_count.sql: failing
-- or parked, in the retry lane) becomes claimable now. Rows deferred behind
-- them follow when they are published.
update outbox_events
   set next_attempt_at = now(), attempts = 0
 where published_at is null
   and skipped_at is null
   and next_attempt_at is not null
   and (attempts > 0 or not isfinite(next_attempt_at))
returning id as "id!"
