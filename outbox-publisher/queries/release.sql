-- Give back claimed rows this relay did not try (shutdown, or behind a failure
-- of their subject). $1 ids.
update outbox_events
   set locked_until = null
 where id = any($1::uuid[])
   and published_at is null
