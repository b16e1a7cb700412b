-- Published rows of one stream to audit, oldest first, per shard after a
-- keyset mark. Read through outbox_events_published_idx (published_at, on
-- published rows).
--   $1 stream; $2 shards; $3, $4 per shard, the (published_at, id) after which
--   to read; $5 the earliest of $3; $6 read rows published at or before this;
--   $7 rows to read.
select e.id as "id!", e.shard as "shard!", e.event_type as "event_type!",
       e.subject as "subject!", e.published_seq as "seq!",
       e.published_at as "published_at!"
  from unnest($2::smallint[], $3::timestamptz[], $4::uuid[]) as s(shard, after_at, after_id)
  join outbox_events e on e.shard = s.shard
 where e.published_at is not null
   and e.published_at >= $5::timestamptz
   and e.published_at <= $6::timestamptz
   and (e.published_at, e.id) > (s.after_at, s.after_id)
   and e.published_stream = $1
   and e.published_seq is not null
 order by e.published_at, e.id
 limit $7
