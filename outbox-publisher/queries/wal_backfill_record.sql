-- Records that slot $1's backfill is done, up to seq $2 (outbox_relay_slots).
insert into outbox_relay_slots (slot_name, floor)
values ($1, $2)
on conflict (slot_name) do update
   set floor = excluded.floor, backfilled_at = now()
