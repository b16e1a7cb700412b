-- The WAL source's look for rows it left behind. Per shard $1[i], the oldest
-- fresh row (neither published nor in the retry lane) with a seq above $2[i]
-- (at first the floor: rows at or below it are the polling path's) and at or
-- below $3, the settled horizon (above it, rows of transactions still running
-- are in the index and would each be visited and found invisible), one range
-- scan of outbox_events_shard_seq_idx each; and the WAL insert position now.
-- Every row this statement sees was committed before its snapshot, so its
-- commit is in the WAL before that position: once the slot's confirmed
-- position passes it, the WAL source has read, published and recorded every
-- one of these rows, and any still fresh then was left behind.
select p.shard as "shard!",
       e.id as "id!",
       e.seq as "seq!",
       (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint as "lsn!"
  from unnest($1::smallint[], $2::bigint[]) as p(shard, after)
  cross join lateral (
    select o.id, o.seq
      from outbox_events o
     where o.shard = p.shard
       and o.published_at is null
       and o.next_attempt_at is null
       and o.seq > p.after
       and o.seq <= $3
     order by o.seq
     limit 1
  ) e
