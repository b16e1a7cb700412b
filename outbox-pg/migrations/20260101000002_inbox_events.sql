-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- The consumer's inbox: one row per (consumer, event) it has handled. The primary
-- key is the whole dedupe mechanism; the row commits with the handler's work.
create table if not exists inbox_events (
  consumer    text        not null,
  event_id    uuid        not null,
  event_type  text        not null,
  subject     text        not null,
  event_time  timestamptz not null,
  handled_at  timestamptz not null default now(),
  primary key (consumer, event_id)
);

do $$
begin
  -- Retention deletes by age.
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'inbox_events_handled_at_idx') then
    create index inbox_events_handled_at_idx
      on inbox_events (handled_at);
  end if;

  -- "When was the last event applied for this subject?" for order-dependent handlers.
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'inbox_events_subject_time_idx') then
    create index inbox_events_subject_time_idx
      on inbox_events (consumer, subject, event_time desc);
  end if;
end
$$;
