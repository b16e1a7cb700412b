-- What a drain (`outbox-relay --once`) still has to see published: the rows
-- of every shard, whoever owns it, that were due when the drain looked — main
-- lane rows at or below the seq the drain started at, retry lane rows due
-- now below the attempt cap, and scheduled rows fallen due. Rows in backoff,
-- parked, skipped or cancelled are not waited for. Each lane is read on its
-- own index (scheduled rows by due time, up to now()), so rows scheduled for
-- later are never read.
--   $1 the last seq handed out when the drain started; $2 max attempts
with main as (
  select shard
    from outbox_events
   where published_at is null and next_attempt_at is null
     and seq <= $1 and skipped_at is null
),
retry as (
  select shard
    from outbox_events
   where published_at is null and next_attempt_at is not null and due_at is null
     and next_attempt_at <= now() and attempts < $2 and skipped_at is null
),
due as (
  select shard
    from outbox_events
   where published_at is null and due_at is not null and cancelled_at is null
     and due_at <= now() and next_attempt_at <= now()
     and attempts < $2 and skipped_at is null
),
left_rows as (
  select shard from main union all select shard from retry union all select shard from due
)
select count(*)::bigint as "rows!",
       coalesce(array_agg(distinct shard order by shard), '{}') as "shards!: Vec<i16>"
  from left_rows
