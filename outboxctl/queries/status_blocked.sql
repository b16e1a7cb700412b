-- `outboxctl status`: blocked subjects. A subject is blocked when its earliest
-- unpublished row that is not skipped is parked (past the cap): the relay
-- publishes none of the rows behind it until an operator retries or skips it.
-- Only immediate rows block or wait: a scheduled row (due_at set) is outside
-- its entity's order, so only the retry lane (due_at null) is searched for
-- parked rows (outbox_events_retry_subject_idx, by the subject's hash, then
-- the subject itself), and a subject's main lane only within its shard
-- (outbox_events_shard_seq_idx).
--   $1 max attempts, $2 how many subjects to return (most rows waiting first)
with parked as (
  select distinct on (p.subject)
         p.id, p.subject, p.shard, p.seq, p.event_type, p.attempts, p.last_error, p.created_at
    from outbox_events p
   where p.published_at is null
     and p.next_attempt_at is not null
     and p.due_at is null
     and p.skipped_at is null
     and (p.attempts >= $1 or not isfinite(p.next_attempt_at))
   order by p.subject, p.seq
),
heads as (
  select p.*
    from parked p
   where not exists (select 1
                       from outbox_events e
                      where hashtextextended(e.subject, 0) = hashtextextended(p.subject, 0)
                        and e.subject = p.subject
                        and e.published_at is null
                        and e.next_attempt_at is not null
                        and e.due_at is null
                        and e.skipped_at is null
                        and e.seq < p.seq)
     and not exists (select 1
                       from outbox_events e
                      where e.shard = p.shard
                        and e.subject = p.subject
                        and e.published_at is null
                        and e.next_attempt_at is null
                        and e.seq < p.seq)
),
waiting as (
  select h.*,
         (select count(*)
            from outbox_events w
           where hashtextextended(w.subject, 0) = hashtextextended(h.subject, 0)
             and w.subject = h.subject
             and w.published_at is null
             and w.next_attempt_at is not null
             and w.due_at is null
             and w.skipped_at is null
             and w.seq > h.seq)
       + (select count(*)
            from outbox_events w
           where w.shard = h.shard
             and w.subject = h.subject
             and w.published_at is null
             and w.next_attempt_at is null
             and w.seq > h.seq) as waiting
    from heads h
)
select w.subject as "subject!", w.shard as "shard?", w.id as "head_id!",
       w.event_type as "event_type!", w.attempts as "attempts!", w.last_error as "last_error?",
       case when isfinite(w.created_at) then w.created_at end as "created_at?",
       w.waiting as "waiting!", count(*) over () as "total!"
  from waiting w
 order by w.waiting desc, w.seq
 limit $2
