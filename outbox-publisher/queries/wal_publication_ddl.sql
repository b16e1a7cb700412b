-- The statement creating publication $1 for $2.outbox_events, inserts only
-- (the relay publishes new rows; its own marks are not decoded), with both
-- names quoted by the server.
select format('create publication %I for table %I.outbox_events with (publish = %L)',
              $1::text, $2::text, 'insert') as "ddl!"
