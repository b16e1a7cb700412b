-- What a drain (`outbox-relay --once`) still has to see published: the rows
-- of every shard, whoever owns it, that were due when the drain looked — main
-- lane rows at or below the seq the drain started at, and retry lane rows
-- due now below the attempt cap. Rows in backoff, parked or skipped are not
-- waited for. Scheduled rows count once due, as their lane sees them
-- (next due, not cancelled).
--   $1 the last seq handed out when the drain started; $2 max attempts
select count(*)::bigint as "rows!",
       coalesce(array_agg(distinct shard order by shard), '{}') as "shards!: Vec<i16>"
  from outbox_events
 where published_at is null
   and skipped_at is null
   and cancelled_at is null
   and ((next_attempt_at is null and seq <= $1)
        or (next_attempt_at <= now() and attempts < $2))
