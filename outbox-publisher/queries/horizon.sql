-- One tick of the settled-seq horizon (see relay/horizon.rs).
--   $1 the snapshot of an earlier tick, or null
-- last_seq is read while this statement runs, after its snapshot was taken,
-- so it is paired with the NEXT tick's snapshot by the caller.
select (select case when is_called then last_value else last_value - 1 end
          from outbox_events_seq) as "last_seq!",
       pg_current_snapshot()::text as "snapshot!",
       $1::text is null
         or not exists (select 1
                          from pg_snapshot_xip($1::text::pg_snapshot) as x
                         where not pg_visible_in_snapshot(x, pg_current_snapshot())) as "settled!"
