-- `outboxctl retry <id>…`: the named rows of the retry lane, and scheduled
-- rows fallen due, become claimable now with a fresh attempt budget.
-- last_error is kept (the relay clears it on publish). Rows published,
-- skipped or cancelled meanwhile are left alone, and so is a scheduled row
-- waiting for its time: a retry never makes a row due before its time.
--   $1 ids
update outbox_events
   set next_attempt_at = now(), attempts = 0
 where id = any($1::uuid[])
   and published_at is null
   and skipped_at is null
   and cancelled_at is null
   and next_attempt_at is not null
   and (due_at is null or due_at <= now() or released_at is not null)
returning id as "id!"
