-- Rows held back behind an earlier failed row of their subject move to the
-- retry lane, due when that row is (or after $3 ms when it is parked), so a
-- blocked subject does not fill every batch and the main lane's cursor can
-- move past them.
--   $1 ids, $2 due times (null: the blocker is parked), $3 deferral (ms)
update outbox_events o
   set next_attempt_at = coalesce(d.due, now() + $3::bigint * interval '1 millisecond')
  from unnest($1::uuid[], $2::timestamptz[]) as d(id, due)
 where o.id = d.id
   and o.published_at is null
   and o.skipped_at is null
