-- A row that was published out of the retry lane unblocks its subject: rows
-- deferred behind it (never failed themselves) become due now.
--   $1 subjects
update outbox_events
   set next_attempt_at = now()
 where subject = any($1::text[])
   and published_at is null
   and next_attempt_at > now()
   and attempts = 0
   and skipped_at is null
