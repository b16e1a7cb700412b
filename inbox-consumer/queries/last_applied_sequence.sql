-- The highest sequence already applied by this consumer for this subject,
-- other than the event being handled (whose row is already inserted). Rows
-- without a sequence are not compared by it; the explicit `is not null` lets
-- the planner use the partial index inbox_events_subject_sequence_idx.
select max(sequence) as "last?"
  from inbox_events
 where consumer = $1
   and subject = $2
   and sequence is not null
   and event_id <> $3
