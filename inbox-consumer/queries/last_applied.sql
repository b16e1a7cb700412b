-- The latest event time already applied by this consumer for this subject,
-- other than the event being handled (whose row is already inserted).
-- SkipStale asks it only for an event without a sequence; every applied row
-- counts, with a sequence or without.
select max(event_time) as "last?"
  from inbox_events
 where consumer = $1
   and subject = $2
   and event_id <> $3
