-- `outboxctl prune`: published rows before the cutoff (a range of
-- outbox_events_published_idx). Skipped rows are kept, even one a relay
-- published as it was being skipped. $1 cutoff
select count(*) as "count!"
  from outbox_events
 where published_at is not null
   and published_at < $1::timestamptz
   and skipped_at is null
