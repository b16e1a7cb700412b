-- `outboxctl skip <id>`: the row is abandoned, kept and recorded: out of both
-- of the relay's lanes (due at 'infinity'), never published, never deleted by
-- retention.
--   $1 id, $2 who, $3 why
update outbox_events
   set skipped_at = now(), skipped_by = $2::text, skip_reason = $3::text,
       next_attempt_at = 'infinity'
 where id = $1::uuid
   and published_at is null
   and skipped_at is null
returning skipped_at as "skipped_at!"
