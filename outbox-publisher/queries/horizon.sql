-- One tick of the settled-seq horizon (see relay/horizon.rs).
--   $1 the writers an earlier tick found (transaction ids), or null
-- last_seq is read while this statement runs, and the writers may be read
-- before it, so the caller pairs the last_seq of one tick with the writers
-- of the NEXT tick.
--
-- Writers: the transactions holding a lock on outbox_events that a write
-- takes (an insert's RowExclusiveLock, or stronger), with their transaction
-- id. A transaction holds a seq only once it has inserted, and from then
-- until it ends it holds that lock; one that inserts later takes a higher
-- seq. So once every writer found after last_seq was read has ended, no
-- transaction can still commit a row at or below it. Transactions that wrote
-- nothing here (a long report, a transaction in another database, a
-- prepared transaction that wrote elsewhere) are not writers and hold
-- nothing back. pg_locks is readable by every role; a transaction's own lock
-- on its id leads from its relation locks to the id.
select (select case when is_called then last_value else last_value - 1 end
          from outbox_events_seq) as "last_seq!",
       (select coalesce(array_agg(distinct t.transactionid::text::bigint), '{}')
          from pg_locks r
          join pg_locks t on t.virtualtransaction = r.virtualtransaction
                         and t.locktype = 'transactionid'
         where r.locktype = 'relation'
           and r.relation = to_regclass('outbox_events')
           and r.database = (select oid from pg_database where datname = current_database())
           and r.mode not in ('AccessShareLock', 'RowShareLock')) as "writers!",
       $1::bigint[] is null
         or not exists (select 1
                          from pg_locks t
                         where t.locktype = 'transactionid'
                           and t.transactionid::text::bigint = any($1::bigint[])) as "settled!"
