-- When the due lane of shards $1 next has a row to publish, as seconds from
-- now by the database's clock (zero or less: due already, e.g. held by a
-- cancel in progress); NULL when nothing is scheduled. $2 max attempts.
-- - free: per shard, the earliest scheduled row not leased to a relay (not
--   cancelled, parked or skipped: those are due at 'infinity'), one probe of
--   outbox_events_due_idx each;
-- - leased: the earliest end of a lease on a due row (a relay that stopped
--   while publishing it), when the row may be taken again. Only due rows
--   can be leased, so this reads no row due later.
with free as (
  select min(n.next_attempt_at) as at
    from unnest($1::smallint[]) as s(shard)
   cross join lateral (
     select o.next_attempt_at
       from outbox_events o
      where o.shard = s.shard
        and o.published_at is null
        and o.due_at is not null
        and o.cancelled_at is null
        and isfinite(o.next_attempt_at)
        and o.attempts < $2
        and (o.locked_until is null or o.locked_until <= clock_timestamp())
      order by o.next_attempt_at
      limit 1
   ) n
),
leased as (
  select min(o.locked_until) as at
    from outbox_events o
   where o.shard = any($1::smallint[])
     and o.published_at is null
     and o.due_at is not null
     and o.cancelled_at is null
     and o.next_attempt_at <= clock_timestamp()
     and o.locked_until > clock_timestamp()
)
select extract(epoch from least(free.at, leased.at) - clock_timestamp())::float8 as "in_secs?"
  from free, leased
