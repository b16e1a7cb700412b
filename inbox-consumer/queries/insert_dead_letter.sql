-- Records a dead letter once per message: a redelivery of a message whose dead
-- letter already committed (its Term was lost) finds that row, by consumer,
-- stream, stream sequence and the same bytes, and returns its id instead of
-- writing a second row. JetStream hands a message to one replica at a time
-- (the runtime holds it with in-progress acks), so two writers of the same
-- dead letter at once are not expected; if they happen, both rows are kept.
with earlier as (
  select id
    from inbox_dead_letters
   where consumer = $1 and stream = $2 and stream_sequence = $3 and payload = $10
   order by id
   limit 1
), written as (
  insert into inbox_dead_letters
    (consumer, stream, stream_sequence, subject, event_id, delivery_count, reason, error, headers, payload, raw_headers)
  select $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11
   where not exists (select 1 from earlier)
  returning id
)
select id as "id!" from written
union all
select id from earlier
