-- The current leader's epoch. A statement of its own, after lease_fence_shared.sql, so
-- its snapshot is taken once the lock is held.
select epoch from inbox_leases where consumer = $1
