-- Of these events, the ones this consumer has finished: handled (in the inbox)
-- or dead-lettered. A taking-over leader need not wait for them.
select event_id as "event_id!" from inbox_events where consumer = $1 and event_id = any($2)
union
select event_id from inbox_dead_letters where consumer = $1 and event_id = any($2)
