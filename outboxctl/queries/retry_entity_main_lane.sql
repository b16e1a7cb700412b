-- `outboxctl retry --entity S`: rows of subject $1 in the main lane, already
-- claimable (outbox_events_shard_seq_idx, within the subject's shard).
--   $1 subject
select count(*) as "count!"
  from outbox_events
 where shard = (hashtextextended($1::text, 0) & 63)::smallint
   and subject = $1::text
   and published_at is null
   and next_attempt_at is null
