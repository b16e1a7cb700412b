-- One statement for every failed row of a batch: the row moves to the retry
-- lane, due after its backoff.
--   $1 ids, $2 errors, $3 retry delays (ms), $4 permanent?, $5 max attempts
-- A permanent failure (a row that can never be published as it is) goes
-- straight to the cap. A row at the cap is parked: due at 'infinity', read
-- again only after an operator resets it. A row an operator skipped while it
-- was being published stays skipped. Returns the rows now parked.
update outbox_events o
   set attempts = case when f.permanent then greatest(o.attempts + 1, $5) else o.attempts + 1 end,
       last_error = f.error,
       next_attempt_at = case when f.permanent or o.attempts + 1 >= $5 then 'infinity'::timestamptz
                              else now() + f.delay_ms * interval '1 millisecond' end
  from unnest($1::uuid[], $2::text[], $3::bigint[], $4::bool[]) as f(id, error, delay_ms, permanent)
 where o.id = f.id
   and o.published_at is null
   and o.skipped_at is null
returning o.id, o.subject, o.event_type, o.attempts, o.last_error
