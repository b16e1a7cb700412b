-- Backlog gauges. $1 max attempts. Rows an operator skipped are neither.
-- Each part is read on the index of its lane, so scheduled rows cost the
-- immediate figures nothing, and the due lane's figures are read from its
-- index alone (next_attempt_at is in it; parked and skipped scheduled rows
-- are due at 'infinity').
-- - backlog: immediate rows under the cap, and scheduled rows fallen due;
-- - past_cap: rows parked at the cap;
-- - oldest_age_secs: how long the oldest of the backlog has waited (since
--   its insert, or since its due time);
-- - scheduled: scheduled rows not due yet; next_due: the earliest of them.
with main as (
  select count(*) filter (where attempts < $1) as backlog,
         count(*) filter (where attempts >= $1) as past_cap,
         min(created_at) filter (where attempts < $1) as oldest
    from outbox_events
   where published_at is null and next_attempt_at is null
),
retry as (
  select count(*) filter (where attempts < $1) as backlog,
         count(*) filter (where attempts >= $1) as past_cap,
         min(created_at) filter (where attempts < $1) as oldest
    from outbox_events
   where published_at is null and next_attempt_at is not null and due_at is null
     and skipped_at is null
),
due as (
  select count(*) filter (where next_attempt_at <= now()) as backlog,
         count(*) filter (where not isfinite(next_attempt_at)) as parked,
         count(*) filter (where next_attempt_at > now() and isfinite(next_attempt_at)) as scheduled,
         min(next_attempt_at) filter (where next_attempt_at <= now()) as oldest,
         min(next_attempt_at) filter (where next_attempt_at > now() and isfinite(next_attempt_at))
           as next_due
    from outbox_events
   where published_at is null and due_at is not null and cancelled_at is null
)
select main.backlog + retry.backlog + due.backlog as "backlog!",
       main.past_cap + retry.past_cap + due.parked as "past_cap!",
       coalesce(extract(epoch from now() - least(main.oldest, retry.oldest, due.oldest)), 0)::float8
         as "oldest_age_secs!",
       due.scheduled as "scheduled!",
       extract(epoch from due.next_due)::float8 as "next_due?"
  from main, retry, due
