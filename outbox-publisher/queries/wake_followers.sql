-- A row that was published out of the retry lane unblocks its subject: rows
-- deferred behind it (never failed themselves) become due now.
-- Found by the subjects' hashes (outbox_events_retry_subject_idx), then by the
-- subjects themselves.
-- Scheduled rows are not followers (the due lane holds them to their time).
--   $1 subjects
update outbox_events
   set next_attempt_at = now()
 where hashtextextended(subject, 0) = any(array(select hashtextextended(s, 0)
                                                  from unnest($1::text[]) as s))
   and subject = any($1::text[])
   and published_at is null
   and next_attempt_at > now()
   and attempts = 0
   and due_at is null
   and skipped_at is null
