-- The sessions the creation of a replication slot on backend $1 waits for.
-- PostgreSQL starts a new slot's decoding only once every transaction that
-- was running when it was asked for (and had a transaction id) has ended, in
-- any database of the server: a long transaction elsewhere holds the slot,
-- and so the WAL source, back. A prepared transaction holding it has pid 0.
-- A role without pg_read_all_stats sees the details of its own sessions only.
select w.pid as "pid!",
       a.datname as "database?",
       a.application_name as "application?",
       host(a.client_addr) as "client?",
       a.state as "state?",
       extract(epoch from now() - a.xact_start)::float8 as "age_secs?"
  from unnest(pg_blocking_pids($1)) as w(pid)
  left join pg_stat_activity a on a.pid = w.pid
 order by a.xact_start nulls first
