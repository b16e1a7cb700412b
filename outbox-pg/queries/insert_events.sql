-- One statement for any number of events: one array per column.
insert into outbox_events (id, event_type, source, subject, time, data, traceparent, tracestate)
select *
  from unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::timestamptz[],
              $6::jsonb[], $7::text[], $8::text[])
