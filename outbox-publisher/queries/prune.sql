-- Retention: delete published rows older than the window, a batch at a time,
-- skipping rows another pruner holds. Unpublished rows are never touched, nor
-- rows an operator skipped (kept as the record, even one a relay published
-- while it was being skipped).
--   $1 window (ms), $2 batch size
delete from outbox_events
 where id in (select id
                from outbox_events
               where published_at is not null
                 and published_at < now() - $1::bigint * interval '1 millisecond'
                 and skipped_at is null
               order by published_at
               limit $2
                 for update skip locked)
