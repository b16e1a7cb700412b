-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- Messages a consumer could not handle and will not retry: poison input (not
-- JSON, not a CloudEvent, no valid id, a payload its handler cannot decode), a
-- handler's explicit rejection, or the last allowed delivery failing. The row
-- keeps everything needed to inspect and replay the message by hand.
create table if not exists inbox_dead_letters (
  id              bigserial   primary key,
  consumer        text        not null,
  stream          text        not null,
  stream_sequence bigint      not null,
  -- the NATS subject the message was published on
  subject         text        not null,
  -- the envelope id, when the message had a readable one
  event_id        uuid        null,
  delivery_count  bigint      not null,
  -- a stable code: not_json, not_cloudevent, invalid_id, undecodable_payload,
  -- unroutable, rejected, max_deliveries
  reason          text        not null,
  -- the error that led here, for people
  error           text        not null,
  -- message headers as {"name": ["value", …]}
  headers         jsonb       not null default '{}'::jsonb,
  payload         bytea       not null,
  created_at      timestamptz not null default now()
);

do $$
begin
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'inbox_dead_letters_consumer_created_idx') then
    create index inbox_dead_letters_consumer_created_idx
      on inbox_dead_letters (consumer, created_at);
  end if;
end
$$;
