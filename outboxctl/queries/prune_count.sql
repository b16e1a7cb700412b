-- `outboxctl prune`: published rows before the cutoff (a range of
-- outbox_events_published_idx), and scheduled rows cancelled before it (kept
-- as the record until then), as outbox-publisher's prune.sql takes them.
-- Skipped rows are kept, even one a relay published as it was being skipped.
--   $1 cutoff
select (select count(*)
          from outbox_events
         where published_at is not null
           and published_at < $1::timestamptz
           and skipped_at is null) as "published!",
       (select count(*)
          from outbox_events
         where cancelled_at is not null
           and cancelled_at < $1::timestamptz
           and published_at is null) as "cancelled!"
