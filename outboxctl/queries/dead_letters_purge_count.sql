-- What `dead-letters purge --dry-run` would delete: dead letters recorded
-- before the cutoff ($2), of one consumer ($1) or all (null), per consumer.
select consumer, count(*) as "rows!"
  from inbox_dead_letters
 where ($1::text is null or consumer = $1::text)
   and created_at < $2
 group by consumer
 order by consumer
