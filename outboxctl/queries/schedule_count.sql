-- `outboxctl schedule list`: how many scheduled rows the filters match (as
-- schedule_list.sql, without its limit), read from outbox_events_due_idx, per
-- shard up to the cutoff: the due lane only, never the rest of the table.
--   $1 shards (smallint[]); $2 event type or null; $3 subject or null;
--   $4 cutoff or null; $5 cutoff as milliseconds from now (when $4 is null)
--   or null
select coalesce(sum(n.count), 0)::bigint as "count!"
  from unnest($1::smallint[]) as s(shard)
 cross join lateral (
   select count(*) as count
     from outbox_events o
    where o.shard = s.shard
      and o.published_at is null
      and o.due_at is not null
      and o.cancelled_at is null
      and o.next_attempt_at <= coalesce($4::timestamptz, now() + $5::bigint * interval '1 millisecond',
                                         'infinity'::timestamptz)
      and o.skipped_at is null
      and ($2::text is null or o.event_type = $2::text)
      and ($3::text is null or o.subject = $3::text)
 ) n
 where $3::text is null or s.shard = (hashtextextended($3::text, 0) & 63)::smallint
