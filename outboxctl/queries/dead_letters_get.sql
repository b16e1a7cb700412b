-- Dead letters by id ($1), whole.
select id, consumer, stream, stream_sequence, subject, event_id, delivery_count,
       reason, error, headers, payload, raw_headers, created_at, replay_count, replayed_at
  from inbox_dead_letters
 where id = any($1)
 order by id
