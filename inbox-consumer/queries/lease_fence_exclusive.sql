-- Taken by a new leader around the epoch bump (see lease_fence_shared.sql),
-- on the keys lease_fence_key.sql gives.
select pg_advisory_xact_lock($1, $2)
