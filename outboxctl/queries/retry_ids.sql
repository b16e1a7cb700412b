-- `outboxctl retry <id>…`: the named rows of the retry lane become claimable
-- now with a fresh attempt budget. last_error is kept (the relay clears it on
-- publish). Rows published or skipped meanwhile are left alone.
--   $1 ids
update outbox_events
   set next_attempt_at = now(), attempts = 0
 where id = any($1::uuid[])
   and published_at is null
   and skipped_at is null
   and next_attempt_at is not null
returning id as "id!"
