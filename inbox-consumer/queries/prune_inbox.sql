-- One batch of retention: inbox rows of one consumer handled before the cutoff.
-- SKIP LOCKED so pruning never waits on (or blocks) a handler's transaction.
delete from inbox_events
 where ctid in (
   select ctid
     from inbox_events
    where consumer = $1
      and handled_at < $2
    limit $3
      for update skip locked
 )
