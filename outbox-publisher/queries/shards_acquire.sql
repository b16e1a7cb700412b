-- Try to take these shards; returns the ones taken. $1 namespace, $2 shards.
select s::smallint as "shard!"
  from unnest($2::int[]) as s
 where pg_try_advisory_lock($1::int, s)
