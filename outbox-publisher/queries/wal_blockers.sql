-- For each subject $1 with the lowest seq $2 the WAL source has of it, the
-- first earlier row of the subject waiting in the retry lane (in backoff,
-- parked, or due), which holds every later row of the subject back. Looked
-- up by the subject's hash (outbox_events_retry_subject_idx), then the
-- subject itself. Subjects with nothing waiting return no row. Scheduled rows
-- (the due lane) hold nothing back.
select c.subject as "subject!",
       b.attempts >= $3 or not isfinite(b.next_attempt_at) as "parked!",
       case when b.attempts < $3 and isfinite(b.next_attempt_at) then b.next_attempt_at end
         as "due?"
  from unnest($1::text[], $2::bigint[]) as c(subject, seq)
  cross join lateral (
    select p.attempts, p.next_attempt_at
      from outbox_events p
     where hashtextextended(p.subject, 0) = hashtextextended(c.subject, 0)
       and p.subject = c.subject
       and p.published_at is null
       and p.next_attempt_at is not null
       and p.due_at is null
       and p.skipped_at is null
       and p.seq < c.seq
     order by p.seq
     limit 1
  ) b
