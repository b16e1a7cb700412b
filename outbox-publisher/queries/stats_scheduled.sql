-- Scheduled rows not due yet (the gauge outbox_relay_scheduled_rows): the
-- part of outbox_events_due_at_idx past now(), counted from the index where
-- the visibility map allows. Its cost grows with the rows scheduled, so the
-- relay reads it less often than the other gauges.
select count(*) as "scheduled!"
  from outbox_events
 where published_at is null and due_at is not null and cancelled_at is null
   and due_at > now()
