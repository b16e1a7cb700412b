-- `outboxctl retry --entity S`: every immediate row of subject $1 in the retry
-- lane (the parked or failing head and the rows deferred behind it) becomes
-- claimable now (outbox_events_retry_subject_idx, by the subject's hash, then
-- the subject itself). Scheduled rows (due_at set) are not in that lane nor in
-- the entity's order: retried by id or with --all-stuck.
--   $1 subject
update outbox_events
   set next_attempt_at = now(), attempts = 0
 where hashtextextended(subject, 0) = hashtextextended($1::text, 0)
   and subject = $1::text
   and published_at is null
   and next_attempt_at is not null
   and due_at is null
   and skipped_at is null
returning id as "id!"
