-- When the due lane of shards $1 next has a row to publish, as seconds from
-- now by the database's clock (zero or less: due already, e.g. held by a
-- cancel in progress); NULL when nothing is scheduled. $2 max attempts.
-- Per shard, the earliest scheduled row (not cancelled, parked or skipped:
-- those are due at 'infinity'), one probe of outbox_events_due_idx each.
select extract(epoch from min(n.next_attempt_at) - clock_timestamp())::float8 as "in_secs?"
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
    order by o.next_attempt_at
    limit 1
 ) n
