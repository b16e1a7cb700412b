-- `outboxctl prune`: deletes up to $2 published rows before the cutoff $1,
-- oldest first, skipping rows another pruner (a relay's retention) holds, as
-- outbox-publisher's prune.sql does. Unpublished and skipped rows are never
-- touched.
delete from outbox_events
 where id in (select id
                from outbox_events
               where published_at is not null
                 and published_at < $1::timestamptz
                 and skipped_at is null
               order by published_at
               limit $2
                 for update skip locked)
