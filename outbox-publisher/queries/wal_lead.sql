-- The WAL source's leadership of slot $1, held by this session while it
-- lives: one reader per slot, the others stand by.
select pg_try_advisory_lock(hashtext('outbox_relay.wal'), hashtext($1)) as "locked!"
