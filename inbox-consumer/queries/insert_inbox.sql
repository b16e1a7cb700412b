-- The dedupe: one row per (consumer, event). A conflict means the event was
-- already handled by this consumer, so nothing is inserted and the handler is
-- skipped. DO NOTHING (not a failed insert) keeps the transaction usable.
-- $6, the event's `sequence`, is null when the event carries none.
insert into inbox_events (consumer, event_id, event_type, subject, event_time, sequence)
values ($1, $2, $3, $4, $5, $6)
on conflict (consumer, event_id) do nothing
