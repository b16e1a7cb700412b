-- `outboxctl skip <id>`: the row, locked until the skip commits, and the
-- database role doing it.
--   $1 id
select id as "id!", subject as "subject!", seq as "seq!",
       published_at as "published_at?",
       skipped_at as "skipped_at?", skipped_by as "skipped_by?", skip_reason as "skip_reason?",
       current_user::text as "role!"
  from outbox_events
 where id = $1::uuid
   for update
