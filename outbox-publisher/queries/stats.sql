-- Backlog gauges. $1 max attempts. Rows an operator skipped or cancelled are
-- neither. Each part is read on the index of its lane, and none reads a
-- scheduled row not due yet, so a million of them cost these figures
-- nothing (their count is stats_scheduled.sql's, read less often).
-- - backlog: immediate rows under the cap, and scheduled rows fallen due
--   (by due_at: one backed off after a failure is still due);
-- - past_cap: rows parked at the cap (a scheduled one: next_attempt_at
--   'infinity');
-- - oldest_age_secs: how long the oldest of the backlog has waited (since
--   its insert, or since its due time);
-- - next_due: the earliest due time still ahead (Unix seconds).
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
-- Fallen due: a range of outbox_events_due_at_idx up to now().
fallen as (
  select count(*) filter (where isfinite(next_attempt_at)) as backlog,
         count(*) filter (where not isfinite(next_attempt_at) and skipped_at is null) as parked,
         min(due_at) filter (where isfinite(next_attempt_at)) as oldest
    from outbox_events
   where published_at is null and due_at is not null and cancelled_at is null
     and due_at <= now()
),
ahead as (
  select min(due_at) as next_due
    from outbox_events
   where published_at is null and due_at is not null and cancelled_at is null
     and due_at > now()
)
select main.backlog + retry.backlog + fallen.backlog as "backlog!",
       main.past_cap + retry.past_cap + fallen.parked as "past_cap!",
       coalesce(extract(epoch from now() - least(main.oldest, retry.oldest, fallen.oldest)), 0)::float8
         as "oldest_age_secs!",
       extract(epoch from ahead.next_due)::float8 as "next_due?"
  from main, retry, fallen, ahead
