-- The consumer a new durable name replaces: another name on the same stream
-- with the same filter subjects (both sorted) that no runtime runs any more
-- (stopped, or silent for 30 s: the runtime writes its row every few
-- seconds), the one updated last. A name still in use is another consumer.
select consumer, ack_floor
  from inbox_consumers
 where consumer <> $1 and stream = $2 and filter_subjects = $3::text[]
   and (stopped_at is not null or updated_at < now() - interval '30 seconds')
 order by updated_at desc
 limit 1
