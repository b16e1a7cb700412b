-- `outboxctl status`: unpublished rows per event type and state. Reads only
-- unpublished rows (the partial index outbox_events_unpublished_idx), so its
-- cost follows them (the backlog, the scheduled rows and the cancelled ones
-- kept as the record), not the table. Every unpublished row is in exactly one
-- state:
--   fresh       the main lane (next_attempt_at null): claimable now
--   due         scheduled, fallen due (by the database's clock), never failed:
--               claimable now by the due lane (or being published)
--   in_backoff  failed (attempts > 0), below the cap, due at next_attempt_at
--               (a scheduled row fallen due whose attempt failed, too)
--   deferred    never failed, waiting behind a failed earlier row of its subject
--   parked      past the cap: attempts >= $1, or due at 'infinity'
--   scheduled   scheduled, not due yet, not taken by a relay: waiting for its
--               time, no backlog
--   cancelled   scheduled and cancelled: never published, kept as the record
--               until retention deletes it
--   skipped     abandoned by an operator: kept, never published
-- The backlog ("unpublished") is fresh + due + in_backoff + deferred + parked;
-- its oldest age counts from a row's insert, or a scheduled row's due time.
--   $1 max attempts (the relay's --max-attempts)
with states as (
  select event_type, created_at, due_at,
         case when cancelled_at is not null then 'cancelled'
              when skipped_at is not null then 'skipped'
              when due_at > now() and released_at is null then 'scheduled'
              when next_attempt_at is null then 'fresh'
              when attempts >= $1 or not isfinite(next_attempt_at) then 'parked'
              when due_at is not null and (attempts > 0 or next_attempt_at > now()) then 'in_backoff'
              when due_at is not null then 'due'
              when attempts > 0 then 'in_backoff'
              else 'deferred' end as state
    from outbox_events
   where published_at is null
),
types as (
  select event_type,
         count(*) filter (where state in ('fresh', 'due', 'in_backoff', 'deferred', 'parked'))
           as unpublished,
         count(*) filter (where state = 'fresh') as fresh,
         count(*) filter (where state = 'due') as due,
         count(*) filter (where state = 'in_backoff') as in_backoff,
         count(*) filter (where state = 'deferred') as deferred,
         count(*) filter (where state = 'parked') as parked,
         count(*) filter (where state = 'skipped') as skipped,
         count(*) filter (where state = 'scheduled') as scheduled,
         count(*) filter (where state = 'cancelled') as cancelled,
         min(coalesce(due_at, created_at))
           filter (where state in ('fresh', 'due', 'in_backoff', 'deferred', 'parked')) as oldest,
         min(due_at) filter (where state = 'scheduled') as next_due
    from states
   group by event_type
)
select event_type as "event_type!", unpublished as "unpublished!", fresh as "fresh!",
       due as "due!", in_backoff as "in_backoff!", deferred as "deferred!", parked as "parked!",
       skipped as "skipped!", scheduled as "scheduled!", cancelled as "cancelled!",
       extract(epoch from now() - oldest)::float8 as "oldest_age_secs?",
       case when isfinite(next_due) then next_due end as "next_due_at?",
       case when isfinite(next_due) then extract(epoch from next_due - now()) end::float8
         as "next_due_in_secs?"
  from types
 order by event_type
