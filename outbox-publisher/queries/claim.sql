-- Claim a batch from the shards one worker holds. Nothing is written: a shard
-- has one owner, so no other relay reads these rows meanwhile, and the caller
-- publishes outside any transaction.
--   $1 shards (smallint[]); $2 their cursors (bigint[]): every row of the
--   shard's main lane at or below the cursor is resolved; $3 rows to read per
--   shard (int[]); $4 max attempts; $5 byte budget of the batch; $6 largest
--   message (bytes); $7 rows to read from the retry lane; $8 the highest seq
--   the main lane may give (the WAL source publishes the rows above it).
--
-- 1. main: per shard, the main lane (fresh rows) after the cursor, in seq
--    order: one index range scan that starts past every row already published,
--    so dead entries of published rows are never read again.
-- 2. retry: rows of these shards in the retry lane whose time has come.
--    Scheduled rows (due_at set) are not in it: the due lane publishes them
--    (due_claim.sql), and they neither block nor wait behind these.
-- 3. blocker: per candidate, the first earlier row of its subject that waits in
--    the retry lane and is not itself a candidate (in backoff, or parked past
--    the cap). A blocked candidate is not published; the caller defers it. A
--    row an operator skipped (skipped_at set; it stays in the retry lane, due
--    at 'infinity') blocks nothing. Looked up by the subject's hash, which
--    outbox_events_retry_subject_idx holds (any subject length), then by the
--    subject itself.
-- 4. Values a client cannot decode are turned into NULLs here, so one bad row
--    can never fail the claim for the others: a time outside years 1-9999
--    (RFC 3339) or infinite, and data over the largest message (not fetched).
--    Rows past the byte budget come without data and are left for the next
--    batch. Sizes are the stored size of small uncompressed values (no
--    rendering) and the text length of the others, so the bound holds for
--    compressed values too.
-- 5. Column names carry the query macro's overrides: `!` not null, `?`
--    nullable, `: _` decoded leniently (see ClaimRecord in src/store.rs).
with main as (
  select r.*
    from unnest($1::smallint[], $2::bigint[], $3::int[]) as s(shard, after, rows)
   cross join lateral (
     select e.id, e.seq, e.shard, e.event_type, e.source, e.subject, e.time, e.data, e.created_at,
            e.attempts, e.traceparent, e.tracestate, false as retry
       from outbox_events e
      where e.shard = s.shard
        and e.published_at is null
        and e.next_attempt_at is null
        and e.seq > s.after
        and e.seq <= $8
      order by e.seq
      limit s.rows
   ) r
),
retry as (
  select e.id, e.seq, e.shard, e.event_type, e.source, e.subject, e.time, e.data, e.created_at,
         e.attempts, e.traceparent, e.tracestate, true as retry
    from outbox_events e
   where e.shard = any($1::smallint[])
     and e.published_at is null
     and e.next_attempt_at is not null
     and e.next_attempt_at <= now()
     and e.due_at is null
     and e.attempts < $4
     and e.skipped_at is null
   order by e.next_attempt_at
   limit $7
),
candidates as materialized (
  select * from main union all select * from retry
),
ids as (
  select coalesce(array_agg(id), '{}') as ids from candidates
),
-- Whether any row of these shards waits in the retry lane at all: when none
-- does (the common case), no candidate needs a blocker lookup.
-- One probe of outbox_events_retry_idx per shard, in every plan: asked as
-- one `exists` over all the shards, the planner (misled by the scheduled
-- rows, which also have next_attempt_at set) read the whole table.
retrying as (
  select exists (select 1
                   from unnest($1::smallint[]) as s(shard)
                  cross join lateral (
                    select 1
                      from outbox_events r
                     where r.shard = s.shard
                       and r.published_at is null
                       and r.next_attempt_at is not null
                       and r.due_at is null
                       and r.skipped_at is null
                     order by r.next_attempt_at
                     limit 1
                  ) r) as found
),
-- Sizes without rendering the JSON where the stored size tells: for a
-- compressed or large value it does not, and its text length is taken.
sized as (
  select c.*,
         case when pg_column_compression(c.data) is not null or pg_column_size(c.data) > 8192
              then octet_length(c.data::text)
              else pg_column_size(c.data) end as data_len
    from candidates c
),
row_sizes as (
  select s.*,
         s.data_len + octet_length(s.event_type) + octet_length(s.source)
           + octet_length(s.subject) + coalesce(octet_length(s.traceparent), 0)
           + coalesce(octet_length(s.tracestate), 0) as size
    from sized s
),
-- Bytes of the rows before each one (a running sum, computed incrementally).
budget as (
  select r.*, sum(r.size) over (order by r.seq rows unbounded preceding) - r.size as before
    from row_sizes r
)
select c.id as "id!", c.seq as "seq!", c.shard as "shard!", c.retry as "retry!",
       c.event_type as "event_type!: _", c.source as "source!: _", c.subject as "subject!: _",
       case when isfinite(c.time)
             and c.time >= '0001-01-01 00:00:00+00' and c.time < '10000-01-01 00:00:00+00'
            then c.time end as "time?: _",
       case when isfinite(c.created_at)
             and c.created_at >= '0001-01-01 00:00:00+00' and c.created_at < '10000-01-01 00:00:00+00'
            then c.created_at end as "created_at?: _",
       c.attempts as "attempts!", c.traceparent as "traceparent?: _", c.tracestate as "tracestate?: _",
       c.data_len::bigint as "data_len!",
       coalesce(c.before, 0) > 0 and coalesce(c.before, 0) + c.data_len > $5::bigint as "over_budget!",
       case when c.data_len <= $6::bigint
             and not (coalesce(c.before, 0) > 0 and coalesce(c.before, 0) + c.data_len > $5::bigint)
            then c.data::text end as "data?: _",
       b.seq is not null as "blocked!",
       b.seq is not null and (b.attempts >= $4 or not isfinite(b.next_attempt_at)) as "blocker_parked!",
       case when b.seq is not null and b.attempts < $4 and isfinite(b.next_attempt_at)
            then b.next_attempt_at end as "blocker_due?: _",
       coalesce(b.next_attempt_at <= now(), false) as "blocker_due_now!",
       null::timestamptz as "due_at?: _", null::float8 as "late_secs?"
  from budget c
  left join lateral (
    select p.seq, p.attempts, p.next_attempt_at
      from outbox_events p
     where (select found from retrying)
       and hashtextextended(p.subject, 0) = hashtextextended(c.subject, 0)
       and p.subject = c.subject
       and p.published_at is null
       and p.next_attempt_at is not null
       and p.due_at is null
       and p.skipped_at is null
       and p.seq < c.seq
       and p.id <> all((select ids from ids)::uuid[])
     order by p.seq
     limit 1
  ) b on true
 order by c.seq
