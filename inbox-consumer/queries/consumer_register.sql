-- Records the consumer at start: its stream, filter subjects and ack floor.
-- The floor only rises while the stream stays the same.
insert into inbox_consumers as c (consumer, stream, filter_subjects, ack_floor)
values ($1, $2, $3::text[], $4)
on conflict (consumer) do update
   set stream = excluded.stream,
       filter_subjects = excluded.filter_subjects,
       ack_floor = case when c.stream = excluded.stream
                        then greatest(c.ack_floor, excluded.ack_floor)
                        else excluded.ack_floor end,
       updated_at = now(),
       stopped_at = null
