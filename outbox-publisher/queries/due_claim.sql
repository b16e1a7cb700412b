-- The due lane's claim: scheduled rows of the shards $1 whose time has come
-- (next_attempt_at, at or after due_at, passed by the database's clock), taken
-- for publishing in one short statement.
--   $1 shards (smallint[]); $2 max attempts; $3 rows; $4 byte budget of the
--   batch; $5 largest message (bytes); $6 rows read per shard at most
--
-- - Per shard, one range scan of outbox_events_due_idx up to now(), at most
--   $6 rows deep: rows due later are never read, however many there are, and
--   a burst due at once costs a claim a few rows per shard, not a batch per
--   shard; then at most $3 of them in due order.
-- - The rows are then found by primary key, one lookup per id
--   (`= any(array(…))`, which the planner can only look up), in every plan:
--   a generic plan cached while the table was empty otherwise scanned every
--   unpublished row per claim.
-- - `for update skip locked`: a row a cancel holds (the canceller's
--   transaction still open) is passed over, and read again next time; it is
--   then cancelled, or the cancel rolled back. The row is checked again as it
--   is when locked: a cancel, a skip or another relay's take may have
--   committed since this statement's snapshot.
-- - released_at is set on the first take: from then on a cancel answers
--   "already published" (the row will be published, at least once). No
--   lease is written: as for immediate rows, a shard has one owner, and a
--   deposed owner finishing its batch while the new owner starts publishes
--   rows the stream's duplicate window then stores once; a relay killed
--   mid-batch leaves its rows to the relay that takes over its shards, at
--   once.
-- - The columns are those of claim.sql (the rows become the same ClaimedRow),
--   plus the due time and how late the row is (by the database's clock).
with due as materialized (
  select d.id
    from unnest($1::smallint[]) as s(shard)
   cross join lateral (
     select o.id, o.next_attempt_at, o.seq
       from outbox_events o
      where o.shard = s.shard
        and o.published_at is null
        and o.due_at is not null
        and o.cancelled_at is null
        and o.next_attempt_at <= now()
        and o.attempts < $2
        and o.skipped_at is null
      order by o.next_attempt_at, o.seq
      limit $6
   ) d
   order by d.next_attempt_at, d.seq
   limit $3
),
locked as materialized (
  select o.id
    from outbox_events o
   where o.id = any(array(select id from due))
     and o.published_at is null
     and o.cancelled_at is null
     and o.skipped_at is null
     and o.next_attempt_at <= now()
     for update skip locked
),
taken as (
  update outbox_events o
     set released_at = coalesce(o.released_at, now())
   where o.id = any(array(select id from locked))
  returning o.id, o.seq, o.shard, o.event_type, o.source, o.subject, o.time, o.data,
            o.created_at, o.attempts, o.traceparent, o.tracestate, o.due_at, o.next_attempt_at
),
sized as (
  select t.*,
         case when pg_column_compression(t.data) is not null or pg_column_size(t.data) > 8192
              then octet_length(t.data::text)
              else pg_column_size(t.data) end as data_len
    from taken t
),
budget as (
  select s.*,
         sum(s.data_len + octet_length(s.event_type) + octet_length(s.source)
             + octet_length(s.subject))
           over (order by s.due_at, s.seq rows unbounded preceding)
           - (s.data_len + octet_length(s.event_type) + octet_length(s.source)
              + octet_length(s.subject)) as before
    from sized s
)
select c.id as "id!", c.seq as "seq!", c.shard as "shard!", false as "retry!",
       c.event_type as "event_type!: _", c.source as "source!: _", c.subject as "subject!: _",
       case when isfinite(c.time)
             and c.time >= '0001-01-01 00:00:00+00' and c.time < '10000-01-01 00:00:00+00'
            then c.time end as "time?: _",
       case when isfinite(c.created_at)
             and c.created_at >= '0001-01-01 00:00:00+00' and c.created_at < '10000-01-01 00:00:00+00'
            then c.created_at end as "created_at?: _",
       c.attempts as "attempts!", c.traceparent as "traceparent?: _", c.tracestate as "tracestate?: _",
       c.data_len::bigint as "data_len!",
       coalesce(c.before, 0) > 0 and coalesce(c.before, 0) + c.data_len > $4::bigint as "over_budget!",
       case when c.data_len <= $5::bigint
             and not (coalesce(c.before, 0) > 0 and coalesce(c.before, 0) + c.data_len > $4::bigint)
            then c.data::text end as "data?: _",
       false as "blocked!", false as "blocker_parked!",
       null::timestamptz as "blocker_due?: _", false as "blocker_due_now!",
       case when isfinite(c.due_at)
             and c.due_at >= '0001-01-01 00:00:00+00' and c.due_at < '10000-01-01 00:00:00+00'
            then c.due_at end as "due_at?: _",
       greatest(extract(epoch from now() - c.due_at), 0)::float8 as "late_secs?"
  from budget c
 order by c.due_at, c.seq
