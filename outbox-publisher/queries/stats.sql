-- Backlog gauges. $1 max attempts. Rows an operator skipped or cancelled are
-- neither. Each part is read on the index of its lane, so scheduled rows cost
-- the immediate figures nothing, and the due lane's figures are read from its
-- index alone (outbox_events_due_idx holds next_attempt_at and due_at).
-- - backlog: immediate rows under the cap, and scheduled rows fallen due
--   (by due_at: one backed off after a failure is still due);
-- - past_cap: rows parked at the cap (a scheduled one: next_attempt_at
--   'infinity');
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
  select count(*) filter (where due_at <= now() and isfinite(next_attempt_at)) as backlog,
         count(*) filter (where due_at > now() and isfinite(next_attempt_at)) as scheduled,
         min(due_at) filter (where due_at <= now() and isfinite(next_attempt_at)) as oldest,
         min(due_at) filter (where due_at > now() and isfinite(next_attempt_at)) as next_due
    from outbox_events
   where published_at is null and due_at is not null and cancelled_at is null
),
-- Parked scheduled rows (due at 'infinity'), skipped ones apart: per shard
-- (the migration's 64), a range of the index at 'infinity' each.
parked as (
  select count(*) as n
    from generate_series(0, 63) as s(shard)
   cross join lateral (
     select 1
       from outbox_events o
      where o.shard = s.shard
        and o.published_at is null and o.due_at is not null and o.cancelled_at is null
        and o.next_attempt_at = 'infinity'
        and o.skipped_at is null
   ) p
)
select main.backlog + retry.backlog + due.backlog as "backlog!",
       main.past_cap + retry.past_cap + parked.n as "past_cap!",
       coalesce(extract(epoch from now() - least(main.oldest, retry.oldest, due.oldest)), 0)::float8
         as "oldest_age_secs!",
       due.scheduled as "scheduled!",
       extract(epoch from due.next_due)::float8 as "next_due?"
  from main, retry, due, parked
