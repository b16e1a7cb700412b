-- The floor of slot $1's backfill, if one was done and recorded
-- (outbox_relay_slots): rows at or below it were published through the
-- polling path; every other row is in the slot's stream.
select floor as "floor!"
  from outbox_relay_slots
 where slot_name = $1
