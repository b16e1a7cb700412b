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

-- Retention deletes by age.
create index if not exists inbox_events_handled_at_idx
  on inbox_events (handled_at);

-- "When was the last event applied for this subject?" for order-dependent handlers.
create index if not exists inbox_events_subject_time_idx
  on inbox_events (consumer, subject, event_time desc);
