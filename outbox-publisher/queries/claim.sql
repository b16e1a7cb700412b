-- Claim a batch in created_at order, keeping every subject in order.
--   $1 batch size, $2 max attempts, $3 lease (ms), $4 deferral behind a row past the cap (ms)
--
-- 1. candidates: the oldest claimable rows (unpublished, under the cap, not in
--    backoff, not leased), locked with SKIP LOCKED so replicas never wait on
--    each other.
-- 2. gaps: per subject among the candidates, the first unpublished row that
--    is NOT a candidate: one that failed and waits in backoff, sits past the
--    cap, or is held by another relay. Only candidates before it are accepted,
--    so a subject is published as a gap-free prefix from its oldest unpublished
--    event and no event overtakes an earlier one of its subject. The gap is
--    found by one ordered index scan per subject that stops at the first
--    non-candidate (a plain index scan also marks dead entries of published
--    rows as killed, so later scans skip them cheaply).
-- 3. Candidates behind a gap that is in backoff or past the cap are deferred to
--    the gap's retry time, so a blocked subject does not fill every batch.
-- 4. Accepted rows get a lease; the caller publishes outside any transaction.
with candidates as materialized (
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
subjects as (
  select subject, array_agg(id) as ids from candidates group by subject
),
gaps as (
  select s.subject, g.created_at as gap_at, g.id as gap_id, g.attempts, g.next_attempt_at
    from subjects s
    left join lateral (
      select p.created_at, p.id, p.attempts, p.next_attempt_at
        from outbox_events p
       where p.subject = s.subject
         and p.published_at is null
         and p.id <> all(s.ids)
       order by p.created_at, p.id
       limit 1
    ) g on true
),
verdicts as (
  select c.id,
         (g.gap_id is null or (c.created_at, c.id) < (g.gap_at, g.gap_id)) as accepted,
         case
           when g.attempts >= $2 then now() + $4 * interval '1 millisecond'
           when g.next_attempt_at > now() then g.next_attempt_at
         end as defer_until
    from candidates c
    join gaps g using (subject)
),
-- (`= any(array(...))` keeps both updates on the primary key; a join on the CTE
-- would be planned as a scan of the whole table.)
deferred as (
  update outbox_events o
     set next_attempt_at = (select v.defer_until from verdicts v where v.id = o.id)
   where o.id = any(array(select id from verdicts where not accepted and defer_until is not null))
),
claimed as (
  update outbox_events o
     set locked_until = now() + $3 * interval '1 millisecond'
   where o.id = any(array(select id from verdicts where accepted))
  returning o.id, o.event_type, o.source, o.subject, o.time, o.data, o.created_at,
            o.attempts, o.traceparent, o.tracestate
)
select id, event_type, source, subject, time, data, created_at, attempts, traceparent, tracestate
  from claimed
 order by created_at, id
