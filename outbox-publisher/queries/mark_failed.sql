-- One statement for every failed row of a batch: the row moves to the retry
-- lane, due after its backoff.
--   $1 ids, $2 errors, $3 retry delays (ms), $4 permanent?, $5 max attempts,
--   $6 counted? (false: the stream does not capture the row's type, which
--   costs it no attempt)
-- A permanent failure (a row that can never be published as it is) goes
-- straight to the cap. A row at the cap is parked: due at 'infinity', read
-- again only after an operator resets it; a failure that is not counted
-- never parks a row. A row an operator skipped while it was being published
-- stays skipped. Returns the rows now parked.
update outbox_events o
   set attempts = case when f.permanent then greatest(o.attempts + 1, $5)
                       when f.counted then o.attempts + 1
                       else o.attempts end,
       last_error = f.error,
       next_attempt_at = case when f.permanent or (f.counted and o.attempts + 1 >= $5) then 'infinity'::timestamptz
                              else now() + f.delay_ms * interval '1 millisecond' end
  from unnest($1::uuid[], $2::text[], $3::bigint[], $4::bool[], $6::bool[])
       as f(id, error, delay_ms, permanent, counted)
 where o.id = f.id
   and o.published_at is null
   and o.skipped_at is null
returning o.id, o.subject, o.event_type, o.attempts, o.last_error
