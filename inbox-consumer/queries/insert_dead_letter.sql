insert into inbox_dead_letters
  (consumer, stream, stream_sequence, subject, event_id, delivery_count, reason, error, headers, payload)
values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
returning id
