-- The due lane's rows of a batch that were not published give back their
-- lease, so they are read again when due (at once, or after their backoff),
-- not when the lease runs out. $1 ids.
update outbox_events
   set locked_until = null
 where id = any($1::uuid[])
   and published_at is null
   and locked_until is not null
