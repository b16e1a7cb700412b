-- The fence of one consumer's leadership. A handler transaction takes it shared
-- just before it reads the epoch and commits; a new leader takes it exclusive
-- while it bumps the epoch. So a new epoch waits for the commits already past
-- their check, and every check after it sees the new epoch.
-- $1, $2: the keys lease_fence_key.sql gives, which the leader reads once.
select pg_advisory_xact_lock_shared($1, $2)
