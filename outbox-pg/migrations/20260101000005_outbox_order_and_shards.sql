-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- Insert order, shards and lanes for the relay. The contract's columns are
-- untouched; everything here is an extension a writer never sets.
--
-- seq: the insert order. Assigned by a trigger at insert time (after the
-- writer's own changes in its transaction), so two transactions that change
-- one entity (row lock, then event) get their seq in the order they changed
-- it, whichever began first. created_at, the transaction's start, cannot say
-- that. The trigger takes the transaction id *before* the sequence number, so
-- every holder of a seq is visible as a running transaction to any snapshot
-- taken after the number was handed out; the relay relies on this to advance
-- its per-shard cursor without ever stepping over a transaction that commits
-- late (the watermark trap).
create sequence if not exists outbox_events_seq as bigint;

do $$
begin
  -- Only when the column is added: run again, the setval below would move the
  -- sequence back to the highest seq still in the table (to 1 on an empty
  -- table), and hand out numbers the relay has already passed.
  if not exists (select from information_schema.columns
                  where table_schema = current_schema()
                    and table_name = 'outbox_events'
                    and column_name = 'seq') then
    alter table outbox_events add column seq bigint;

    -- Rows written before this migration keep their created_at order.
    with ordered as (
      select id, row_number() over (order by created_at, id) as n
        from outbox_events
       where seq is null
    )
    update outbox_events e
       set seq = o.n + coalesce((select max(seq) from outbox_events), 0)
      from ordered o
     where e.id = o.id;

    perform setval('outbox_events_seq',
                   greatest(coalesce((select max(seq) from outbox_events), 0), 1),
                   (select count(*) > 0 from outbox_events));

    alter table outbox_events alter column seq set not null;
  end if;
end
$$;

create or replace function outbox_events_assign_seq() returns trigger
language plpgsql as $$
begin
  if tg_op = 'INSERT' then
    -- Transaction id first, then the number (see above). A value the writer
    -- supplied is replaced: the order is the database's, not the writer's.
    perform pg_current_xact_id();
    new.seq := nextval('outbox_events_seq');
  else
    new.seq := old.seq;
  end if;
  return new;
end;
$$;

do $$
begin
  if not exists (select from pg_trigger t
                   join pg_class c on c.oid = t.tgrelid
                  where c.relnamespace = current_schema()::regnamespace
                    and c.relname = 'outbox_events'
                    and t.tgname = 'outbox_events_assign_seq') then
    create trigger outbox_events_assign_seq
      before insert or update of seq on outbox_events
      for each row execute function outbox_events_assign_seq();
  end if;

  -- shard: 64 buckets by a hash of the entity. Each relay replica owns a set of
  -- shards, so one entity's events are only ever published by one owner.
  -- hashtextextended is the hash PostgreSQL's hash partitioning uses, which is
  -- kept stable across versions.
  if not exists (select from information_schema.columns
                  where table_schema = current_schema()
                    and table_name = 'outbox_events'
                    and column_name = 'shard') then
    alter table outbox_events
      add column shard smallint
      generated always as ((hashtextextended(subject, 0) & 63)::smallint) stored;
  end if;

  -- The main lane: fresh rows, per shard in insert order. The relay reads it
  -- from a cursor, so entries of rows it already published (dead until vacuum
  -- removes them, and kept as long as any snapshot is older) are never scanned
  -- again.
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_shard_seq_idx') then
    create index outbox_events_shard_seq_idx
      on outbox_events (shard, seq)
      where published_at is null and next_attempt_at is null;
  end if;

  -- The retry lane: rows that failed, or wait behind a failed row of their
  -- subject, by due time. Parked rows (past the attempt cap) are due at
  -- 'infinity' and never read by the relay again until an operator resets them.
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_retry_idx') then
    create index outbox_events_retry_idx
      on outbox_events (shard, next_attempt_at)
      where published_at is null and next_attempt_at is not null;
  end if;

  -- "Does an earlier row of this subject wait in the retry lane?"
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'outbox_events_retry_subject_idx') then
    create index outbox_events_retry_subject_idx
      on outbox_events (subject, seq)
      where published_at is null and next_attempt_at is not null;
  end if;

  -- The previous claim's per-subject index (built by earlier versions of
  -- 20260101000001) is no longer read.
  if exists (select from pg_indexes
              where schemaname = current_schema()
                and indexname = 'outbox_events_subject_unpublished_idx') then
    drop index outbox_events_subject_unpublished_idx;
  end if;
end
$$;
