-- `outboxctl schedule list`: scheduled rows neither published, cancelled nor
-- skipped, in the order the relay's due lane takes them: by the time each is
-- next due (its due time; after a failure, its next attempt), then insert
-- order. Read from outbox_events_due_idx: per shard, one range scan up to the
-- cutoff, stopped after $5 rows, so rows due later are never read, however
-- many there are. With a subject, only that subject's shard is read.
--   $1 shards (smallint[]); $2 event type or null; $3 subject or null;
--   $4 cutoff (next due at or before it) or null; $5 limit; $6 max attempts;
--   $7 cutoff as milliseconds from now (when $4 is null) or null
select r.id as "id!", r.event_type as "event_type!", r.subject as "subject!",
       case when isfinite(r.due_at) then r.due_at end as "due_at?",
       case when isfinite(r.next_attempt_at) then r.next_attempt_at end as "next_attempt_at?",
       case when isfinite(r.created_at) then r.created_at end as "created_at?",
       case when isfinite(r.released_at) then r.released_at end as "released_at?",
       r.attempts as "attempts!", r.last_error as "last_error?",
       case when isfinite(r.due_at) then extract(epoch from r.due_at - now()) end::float8
         as "due_in_secs?",
       case when isfinite(r.next_attempt_at) then extract(epoch from r.next_attempt_at - now()) end::float8
         as "next_in_secs?",
       r.due_at <= now() as "fallen_due!",
       r.released_at is not null as "released!",
       (r.attempts >= $6 or not isfinite(r.next_attempt_at)) as "parked!"
  from unnest($1::smallint[]) as s(shard)
 cross join lateral (
   select o.id, o.seq, o.event_type, o.subject, o.due_at, o.next_attempt_at, o.created_at,
          o.released_at, o.attempts, o.last_error
     from outbox_events o
    where o.shard = s.shard
      and o.published_at is null
      and o.due_at is not null
      and o.cancelled_at is null
      and o.next_attempt_at <= coalesce($4::timestamptz, now() + $7::bigint * interval '1 millisecond',
                                        'infinity'::timestamptz)
      and o.skipped_at is null
      and ($2::text is null or o.event_type = $2::text)
      and ($3::text is null or o.subject = $3::text)
    order by o.next_attempt_at, o.seq
    limit $5
 ) r
 where $3::text is null or s.shard = (hashtextextended($3::text, 0) & 63)::smallint
 order by r.next_attempt_at, r.seq
 limit $5
