-- Give up shards this session holds. $1 namespace, $2 shards.
select pg_advisory_unlock($1::int, s)
  from unnest($2::int[]) as s
