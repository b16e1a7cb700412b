-- Backlog gauges. $1 max attempts. Rows an operator skipped are neither.
select count(*) filter (where attempts < $1)                         as "backlog!",
       count(*) filter (where attempts >= $1)                        as "past_cap!",
       coalesce(extract(epoch from now() - min(created_at)), 0)::float8 as "oldest_age_secs!"
  from outbox_events
 where published_at is null
   and skipped_at is null
