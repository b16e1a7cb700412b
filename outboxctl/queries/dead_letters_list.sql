-- Dead letters, newest first, of one consumer ($1) or all (null), of one
-- reason ($2) or all (null), at most $3; the payload only by its size.
select id, consumer, stream, stream_sequence, subject, event_id, delivery_count,
       reason, error, created_at, replay_count, replayed_at,
       octet_length(payload) as "payload_bytes!"
  from inbox_dead_letters
 where ($1::text is null or consumer = $1::text)
   and ($2::text is null or reason = $2::text)
 order by created_at desc, id desc
 limit $3
