-- Join the relays: a shared lock ($1, workers) on this session, which the
-- others count, and which the server drops with the session. Sessions idle
-- longer than the lease are closed by the server, so a frozen relay lets go.
--   $1 namespace, $2 this relay's workers, $3 lease (ms)
select pg_advisory_lock_shared($1::int, $2::int),
       set_config('idle_session_timeout', $3::bigint::text, false)
