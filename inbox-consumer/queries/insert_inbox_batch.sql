-- The dedupe of a batch: the inbox rows of several deliveries of one consumer
-- in one statement. The ids it returns were inserted; an id it does not return
-- was already there, so that delivery is a duplicate and its handler is
-- skipped. The batch holds each id once (a repeat inside a batch is a
-- duplicate before it gets here). $6 holds null for an event without a
-- `sequence`.
insert into inbox_events (consumer, event_id, event_type, subject, event_time, sequence)
select $1, e.event_id, e.event_type, e.subject, e.event_time, e.sequence
  from unnest($2::uuid[], $3::text[], $4::text[], $5::timestamptz[], $6::bigint[])
       as e (event_id, event_type, subject, event_time, sequence)
on conflict (consumer, event_id) do nothing
returning event_id
