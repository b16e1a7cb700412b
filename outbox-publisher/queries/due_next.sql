-- When the due lane of shards $1 next has a row to publish: the earliest
-- next_attempt_at among their scheduled rows (not cancelled, parked or
-- skipped, which are due at 'infinity'), as seconds from now by the
-- database's clock (negative: due already, e.g. held by a cancel in
-- progress or leased to a relay that died). One probe of
-- outbox_events_due_idx per shard. NULL: nothing scheduled.
select extract(epoch from min(n.next_attempt_at) - clock_timestamp())::float8 as "in_secs?"
  from unnest($1::smallint[]) as s(shard)
 cross join lateral (
   select greatest(o.next_attempt_at, coalesce(o.locked_until, o.next_attempt_at))
            as next_attempt_at
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
