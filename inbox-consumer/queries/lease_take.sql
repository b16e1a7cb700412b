-- A new leader's epoch: one more than the last (1 for the first), recorded with
-- the holder. Run inside a transaction holding the fence exclusively, after
-- lease_previous.sql.
insert into inbox_leases (consumer, epoch, holder, acquired_at, released)
values ($1, 1, $2, now(), false)
on conflict (consumer) do update
   set epoch       = inbox_leases.epoch + 1,
       holder      = excluded.holder,
       acquired_at = excluded.acquired_at,
       released    = false
returning epoch
