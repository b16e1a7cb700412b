-- Run before wal_fresh_probe.sql, in its transaction. The probe is an ordered
-- range scan of outbox_events_shard_seq_idx per shard. On the statistics of a
-- table just bulk-loaded (before autoanalyze) the planner took
-- outbox_events_unpublished_idx and a sort instead, and read every
-- unpublished row once per shard (10 s for 1M rows); without sorts that plan
-- is not on offer.
set local enable_sort = off
