-- Which of these transactions, read from the replication stream, are not yet
-- visible to a new statement. The stream carries a transaction once its commit
-- is flushed, a moment before it becomes visible (longer while the commit
-- waits for a synchronous standby): an update of its rows that runs in between
-- does not see them and changes nothing, so the WAL source waits for this to
-- return no row before it writes to rows it read.
--   $1 transaction ids as pgoutput's Begin gives them (32 bits, no epoch).
-- Each is widened to a full id (xid8) as the one within 2^31 of the
-- snapshot's xmax: ids read from the stream are recent, and a running one may
-- be at or above xmax (xmax is one past the newest id to have ended).
with s as (
  select pg_current_snapshot() as snap,
         pg_snapshot_xmax(pg_current_snapshot())::text::bigint as xmax
)
select x as "xid!"
  from s, unnest($1::bigint[]) as x
 where not pg_visible_in_snapshot(
         greatest(s.xmax
                    + (x - (s.xmax & 4294967295) + 6442450944) % 4294967296
                    - 2147483648,
                  3)::text::xid8,
         s.snap)
