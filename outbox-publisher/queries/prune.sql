-- Retention: delete published rows older than the window, a batch at a time,
-- skipping rows another pruner holds. Unpublished rows are never touched, nor
-- rows an operator skipped (kept as the record, even one a relay published
-- while it was being skipped). Scheduled rows cancelled longer ago than the
-- window go too (their record kept that long), in a second pass.
--   $1 window (ms), $2 batch size
with published as (
  select id
    from outbox_events
   where published_at is not null
     and published_at < now() - $1::bigint * interval '1 millisecond'
     and skipped_at is null
   order by published_at
   limit $2
     for update skip locked
),
cancelled as (
  select id
    from outbox_events
   where cancelled_at is not null
     and cancelled_at < now() - $1::bigint * interval '1 millisecond'
     and published_at is null
   order by cancelled_at
   limit $2
     for update skip locked
)
delete from outbox_events
 where id in (select id from published union all select id from cancelled)
