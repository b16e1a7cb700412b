-- Retention: delete published rows older than the window, a batch at a time,
-- skipping rows another pruner holds. Unpublished rows are never touched.
--   $1 window (ms), $2 batch size
delete from outbox_events
 where id in (select id
                from outbox_events
               where published_at is not null
                 and published_at < now() - $1::bigint * interval '1 millisecond'
               order by published_at
               limit $2
                 for update skip locked)
