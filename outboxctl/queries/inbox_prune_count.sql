-- What `inbox prune --dry-run` would delete: inbox rows of one consumer ($1)
-- handled before the cutoff ($2).
select count(*) as "rows!"
  from inbox_events
 where consumer = $1
   and handled_at < $2
