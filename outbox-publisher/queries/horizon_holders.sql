-- The writers (see horizon.sql) a candidate still waits for, with what names
-- them to an operator. A role without pg_read_all_stats sees the details of
-- its own sessions only.
--   $1 the candidate's writers (transaction ids)
select t.transactionid::text as "xid!",
       t.pid as "pid?",
       a.application_name as "application?",
       host(a.client_addr) as "client?",
       a.state as "state?",
       extract(epoch from now() - coalesce(a.xact_start, p.prepared))::float8 as "age_secs?",
       p.gid as "prepared_gid?"
  from pg_locks t
  left join pg_stat_activity a on a.pid = t.pid
  left join pg_prepared_xacts p on p.transaction::text = t.transactionid::text
 where t.locktype = 'transactionid'
   and t.mode = 'ExclusiveLock'
   and t.transactionid::text::bigint = any($1::bigint[])
 order by t.transactionid::text::bigint
