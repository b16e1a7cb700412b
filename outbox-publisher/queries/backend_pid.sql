-- This session's backend pid (the server process serving it).
select pg_backend_pid() as "pid!"
