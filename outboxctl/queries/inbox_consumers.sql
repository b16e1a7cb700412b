-- The consumers known to the inbox tables, without reading every row: a
-- skip-scan (one index probe per distinct consumer) over the primary key of
-- inbox_events (consumer, event_id) and over inbox_dead_letters_consumer_created_idx
-- (consumer, created_at), plus the ordered consumers' lease rows.
with recursive inbox (consumer) as (
  (select consumer from inbox_events order by consumer limit 1)
  union all
  select (select e.consumer from inbox_events e
           where e.consumer > inbox.consumer
           order by e.consumer limit 1)
    from inbox
   where inbox.consumer is not null
), dead (consumer) as (
  (select consumer from inbox_dead_letters order by consumer limit 1)
  union all
  select (select d.consumer from inbox_dead_letters d
           where d.consumer > dead.consumer
           order by d.consumer limit 1)
    from dead
   where dead.consumer is not null
)
select consumer as "consumer!" from inbox where consumer is not null
union
select consumer from dead where consumer is not null
union
select consumer from inbox_leases
order by 1
