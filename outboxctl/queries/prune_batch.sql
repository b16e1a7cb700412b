-- `outboxctl prune`: deletes up to $2 published rows before the cutoff $1,
-- oldest first, and up to $2 scheduled rows cancelled before it, skipping
-- rows another pruner (a relay's retention) holds, as outbox-publisher's
-- prune.sql does. Unpublished rows not cancelled, and skipped rows, are never
-- touched. Returns how many of each went.
with published as (
  select id
    from outbox_events
   where published_at is not null
     and published_at < $1::timestamptz
     and skipped_at is null
   order by published_at
   limit $2
     for update skip locked
),
cancelled as (
  select id
    from outbox_events
   where cancelled_at is not null
     and cancelled_at < $1::timestamptz
     and published_at is null
   order by cancelled_at
   limit $2
     for update skip locked
),
deleted as (
  delete from outbox_events
   where id in (select id from published union all select id from cancelled)
  returning published_at is null as cancelled
)
select count(*) filter (where not cancelled) as "published!",
       count(*) filter (where cancelled) as "cancelled!"
  from deleted
