-- `outboxctl status`: the relays, from the advisory locks they hold in this
-- database (outbox-publisher's relay::shards): each relay's ownership session
-- holds a shared lock ($1, its worker count) and an exclusive lock ($2, shard)
-- per shard it owns. pg_stat_activity names the session; a role without
-- pg_read_all_stats sees only its own sessions' details (the others are null).
--   $1 members key, $2 shards key (outbox_pg::Namespace: per schema). pg_locks
--   shows a key as an unsigned oid: the keys are compared as such.
with locks as (
  select l.pid, l.classid::text::bigint as ns, l.objid::text::bigint as key, l.mode
    from pg_locks l
   where l.locktype = 'advisory'
     and l.objsubid = 2
     and l.granted
     and l.database = (select oid from pg_database where datname = current_database())
     and l.classid::text::bigint in ($1::int::bigint & 4294967295, $2::int::bigint & 4294967295)
),
sessions as (
  select distinct pid from locks
)
select s.pid as "pid!", a.application_name as "application_name?",
       host(a.client_addr) as "client_addr?", a.backend_start as "backend_start?",
       a.state as "state?",
       (select sum(k.key) from locks k where k.pid = s.pid and k.ns = ($1::int::bigint & 4294967295) and k.mode = 'ShareLock')::bigint as "workers?",
       coalesce((select array_agg(k.key::int order by k.key)
                   from locks k
                  where k.pid = s.pid and k.ns = ($2::int::bigint & 4294967295) and k.mode = 'ExclusiveLock'), '{}') as "shards!"
  from sessions s
  left join pg_stat_activity a on a.pid = s.pid
 order by a.backend_start, s.pid
