-- Leadership of one consumer: a session-level advisory lock in its own two-key
-- space. The server releases it when the holder's session ends (the process
-- died, or stayed silent past idle_session_timeout), which is the failover.
select pg_try_advisory_lock(hashtext('inbox_consumer.leader'), hashtext($1)) as "locked!"
