-- Cancel a scheduled row the relay has not taken yet: it leaves the due lane
-- (outbox_events_due_idx holds no cancelled row) and is never published.
-- Under READ COMMITTED a cancel that meets a relay's release (which locks the
-- row for one short statement) waits for it and then finds the row released:
-- it cancels nothing, and cancel_lookup.sql answers "already published".
-- Sent with `execute` (a named statement only when the outbox's are): the
-- answer is the count of rows changed, 1 or 0.
--   $1 id; $2 who cancels (NULL: the session's role)
update outbox_events
   set cancelled_at = now(), cancelled_by = coalesce($2, current_user)
 where id = $1
   and due_at is not null
   and published_at is null
   and released_at is null
   and cancelled_at is null
