-- The consumer a new durable name replaces: another name on the same stream
-- with the same filter subjects (both sorted), the one updated last.
select consumer, ack_floor
  from inbox_consumers
 where consumer <> $1 and stream = $2 and filter_subjects = $3::text[]
 order by updated_at desc
 limit 1
