-- What a cancel that changed nothing found, in a snapshot taken after it:
-- 0, no such row (unknown); 1, a row published, released for publishing or
-- never scheduled (each published, or on its way); 2, a row cancelled before.
-- Sent unchecked (`sqlx::query_scalar`), the one way sqlx lets a statement
-- that returns a value be unnamed behind a transaction pooler.
--   $1 id
select coalesce((select case when cancelled_at is not null then 2 else 1 end
                   from outbox_events
                  where id = $1), 0)::int4
