-- Scheduled events, one statement for any number: one array per column, all
-- due at $9, or $10 ms after the transaction's now() when $9 is NULL. The
-- table's trigger (migration 20260101000016) keeps a scheduled row out of
-- the relay's main and retry lanes until it is due, and clears a due time
-- not after now(): such a row is an immediate event.
insert into outbox_events (id, event_type, source, subject, time, data, traceparent, tracestate,
                           due_at)
select u.*, coalesce($9::timestamptz, now() + $10::bigint * interval '1 millisecond')
  from unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::timestamptz[],
              $6::jsonb[], $7::text[], $8::text[]) as u
