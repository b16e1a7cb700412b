-- Which of the rows $1 are still fresh: neither published nor in the retry
-- lane (no failure, deferral or skip recorded).
select id as "id!"
  from outbox_events
 where id = any($1::uuid[])
   and published_at is null
   and next_attempt_at is null
