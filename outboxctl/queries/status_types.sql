-- `outboxctl status`: unpublished rows per event type and state. Reads only
-- unpublished rows (the partial index outbox_events_unpublished_idx), so its
-- cost follows the backlog, not the table. Every row not skipped is in
-- exactly one state:
--   fresh       the main lane (next_attempt_at null): claimable now
--   in_backoff  failed (attempts > 0), below the cap, due at next_attempt_at
--   deferred    never failed, waiting behind a failed earlier row of its subject
--   parked      past the cap: attempts >= $1, or due at 'infinity'
-- A skipped row (an operator abandoned it) is counted apart, never as backlog.
--   $1 max attempts (the relay's --max-attempts)
select event_type as "event_type!",
       count(*) filter (where skipped_at is null) as "unpublished!",
       count(*) filter (where skipped_at is null and next_attempt_at is null) as "fresh!",
       count(*) filter (where skipped_at is null and next_attempt_at is not null
                          and isfinite(next_attempt_at) and attempts > 0 and attempts < $1) as "in_backoff!",
       count(*) filter (where skipped_at is null and next_attempt_at is not null
                          and isfinite(next_attempt_at) and attempts <= 0 and attempts < $1) as "deferred!",
       count(*) filter (where skipped_at is null and next_attempt_at is not null
                          and (attempts >= $1 or not isfinite(next_attempt_at))) as "parked!",
       count(*) filter (where skipped_at is not null) as "skipped!",
       extract(epoch from now() - min(created_at) filter (where skipped_at is null))::float8 as "oldest_age_secs?"
  from outbox_events
 where published_at is null
 group by event_type
 order by event_type
