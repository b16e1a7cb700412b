-- `outboxctl status`: rows published in the last hour, per event type (a
-- range of the partial index outbox_events_published_idx).
select event_type as "event_type!", count(*) as "published!"
  from outbox_events
 where published_at > now() - interval '1 hour'
 group by event_type
 order by event_type
