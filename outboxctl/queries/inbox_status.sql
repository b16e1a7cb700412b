-- Per consumer of $1: its inbox rows (one pass over its primary-key range),
-- its dead letters (over inbox_dead_letters_consumer_created_idx) and its
-- lease row when it runs ordered.
select c.consumer                as "consumer!",
       i.total                   as "inbox_rows!",
       i.oldest                  as "oldest_handled_at?",
       i.newest                  as "newest_handled_at?",
       extract(epoch from now() - i.oldest)::float8 as "oldest_age_seconds?",
       d.total                   as "dead_letters!",
       d.not_replayed            as "dead_letters_not_replayed!",
       d.newest                  as "newest_dead_letter_at?",
       l.holder                  as "lease_holder?",
       l.epoch                   as "lease_epoch?",
       l.acquired_at             as "lease_acquired_at?",
       l.released                as "lease_released?"
  from unnest($1::text[]) as c (consumer)
 cross join lateral (
   select count(*) as total, min(e.handled_at) as oldest, max(e.handled_at) as newest
     from inbox_events e
    where e.consumer = c.consumer
 ) i
 cross join lateral (
   select count(*) as total,
          count(*) filter (where dl.replay_count = 0) as not_replayed,
          max(dl.created_at) as newest
     from inbox_dead_letters dl
    where dl.consumer = c.consumer
 ) d
  left join inbox_leases l on l.consumer = c.consumer
 order by c.consumer
