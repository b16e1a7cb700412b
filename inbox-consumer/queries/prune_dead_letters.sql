-- One batch of dead-letter retention: rows recorded before the cutoff, of one
-- consumer ($1) or of every consumer ($1 null). SKIP LOCKED so pruning never
-- waits on (or blocks) a dead letter being written or replayed.
--   $1 consumer or null, $2 cutoff, $3 batch size
delete from inbox_dead_letters
 where id in (
   select id
     from inbox_dead_letters
    where ($1::text is null or consumer = $1::text)
      and created_at < $2
    order by created_at
    limit $3
      for update skip locked
 )
