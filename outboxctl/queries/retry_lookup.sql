-- `outboxctl retry <id>…`: the rows named, to check each before changing any.
--   $1 ids
select id as "id!",
       published_at as "published_at?",
       skipped_at as "skipped_at?", skipped_by as "skipped_by?",
       next_attempt_at is null as "main_lane!"
  from outbox_events
 where id = any($1::uuid[])
