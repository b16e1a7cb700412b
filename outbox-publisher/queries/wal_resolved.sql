-- Which of the rows $1 read from the WAL already have an outcome: published
-- (marked), or in the retry lane (failed, deferred, skipped). A row another
-- session cannot see yet (its commit not visible) is not returned, so it is
-- published: a row is passed over only on a visible record of its outcome.
-- Each id is a primary-key lookup.
select id as "id!"
  from outbox_events
 where id = any($1::uuid[])
   and (published_at is not null or next_attempt_at is not null)
