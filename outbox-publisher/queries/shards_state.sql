-- Who holds what, from the lock table: the workers of every live relay (each
-- holds the shared member lock ($1, its worker count)) and the shards other
-- sessions hold (exclusive locks ($2, shard)). pg_locks shows a key as an
-- unsigned oid: the keys are compared as such.
select coalesce(sum(l.objid::text::bigint) filter (where l.classid::text::bigint = ($1::bigint & 4294967295) and l.mode = 'ShareLock'), 0)::bigint as "workers!",
       coalesce(array_agg(l.objid::text::int) filter (where l.classid::text::bigint = ($2::bigint & 4294967295) and l.pid <> pg_backend_pid()), '{}') as "taken!"
  from pg_locks l
 where l.locktype = 'advisory'
   and l.objsubid = 2
   and l.granted
   and l.database = (select oid from pg_database where datname = current_database())
   and l.classid::text::bigint in ($1::bigint & 4294967295, $2::bigint & 4294967295)
