-- Claim a batch in created_at order, keeping every subject in order.
--   $1 batch size, $2 max attempts, $3 lease (ms), $4 deferral behind a row past the cap (ms)
--
-- 1. candidates: the oldest claimable rows (unpublished, under the cap, not in
--    backoff, not leased), locked with SKIP LOCKED so replicas never wait on
--    each other.
-- 2. gaps: per subject, the first unpublished row that is NOT a candidate (one
--    that failed, waits in backoff, is past the cap, or is held by another
--    relay). Only candidates before it are accepted: a subject is published as
--    a gap-free prefix from its oldest unpublished event, so no event overtakes
--    an earlier one of its subject, whatever other replicas hold.
-- 3. Candidates behind a gap that is in backoff or past the cap are deferred to
--    the gap's retry time, so a blocked subject does not fill every batch.
-- 4. Accepted rows get a lease; the caller publishes outside any transaction.
with candidates as (
  select id, subject, created_at
    from outbox_events
   where published_at is null
     and attempts < $2
     and (next_attempt_at is null or next_attempt_at <= now())
     and (locked_until is null or locked_until <= now())
   order by created_at, id
   limit $1
     for update skip locked
),
gaps as (
  select s.subject, g.created_at as gap_at, g.id as gap_id,
         g.attempts as gap_attempts, g.next_attempt_at as gap_next
    from (select distinct subject from candidates) s
    left join lateral (
      select p.created_at, p.id, p.attempts, p.next_attempt_at
        from outbox_events p
       where p.subject = s.subject
         and p.published_at is null
         and not exists (select 1 from candidates c where c.id = p.id)
       order by p.created_at, p.id
       limit 1
    ) g on true
),
verdicts as (
  select c.id,
         (g.gap_id is null or (c.created_at, c.id) < (g.gap_at, g.gap_id)) as accepted,
         case
           when g.gap_attempts >= $2 then now() + $4 * interval '1 millisecond'
           when g.gap_next > now() then g.gap_next
         end as defer_until
    from candidates c
    join gaps g using (subject)
),
deferred as (
  update outbox_events o
     set next_attempt_at = v.defer_until
    from verdicts v
   where o.id = v.id and not v.accepted and v.defer_until is not null
),
claimed as (
  update outbox_events o
     set locked_until = now() + $3 * interval '1 millisecond'
    from verdicts v
   where o.id = v.id and v.accepted
  returning o.id, o.event_type, o.source, o.subject, o.time, o.data, o.created_at,
            o.attempts, o.traceparent, o.tracestate
)
select id, event_type, source, subject, time, data, created_at, attempts, traceparent, tracestate
  from claimed
 order by created_at, id
