-- Taken by a new leader around the epoch bump (see lease_fence_shared.sql).
select pg_advisory_xact_lock(hashtext('inbox_consumer.fence'), hashtext($1))
