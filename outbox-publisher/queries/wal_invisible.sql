-- Which of these transactions, read from the replication stream, are not yet
-- visible to a new statement. The stream carries a transaction once its commit
-- is flushed, a moment before it becomes visible (longer while the commit
-- waits for a synchronous standby): an update of its rows that runs in between
-- does not see them and changes nothing, so the WAL source waits for this to
-- return no row before it writes to rows it read.
--   $1 transaction ids as pgoutput's Begin gives them (32 bits, no epoch);
--   each is widened to a full id with the epoch of the snapshot's xmax (the
--   ids are recent: they ran while the stream was read).
with s as (
  select pg_current_snapshot() as snap,
         pg_snapshot_xmax(pg_current_snapshot())::text::bigint as xmax
)
select x as "xid!"
  from s, unnest($1::bigint[]) as x
 where not pg_visible_in_snapshot(
         greatest(case when ((s.xmax >> 32) << 32 | x) >= s.xmax
                       then ((s.xmax >> 32) << 32 | x) - 4294967296
                       else (s.xmax >> 32) << 32 | x end, 3)::text::xid8,
         s.snap)
