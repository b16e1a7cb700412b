-- Forgets slot $1's backfill, before the slot is made (again): a record
-- never speaks of a slot made after it.
delete from outbox_relay_slots
 where slot_name = $1
