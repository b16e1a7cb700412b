-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- Where the broker stored each published row: the stream and sequence of its
-- JetStream PubAck (for a duplicate ack, the message already stored under the
-- row's id), set by the relay in the statement that sets published_at and
-- cleared with it. The relay's audit reads the message back at this position
-- and checks its id, so an acknowledged message the stream later lost is found
-- and published again. Extensions: writers never set them; a relay on a sink
-- that reports no position leaves them null, and such rows are not audited.
--
-- Both columns are nullable without a default, so adding them rewrites
-- nothing and holds the table's lock only for the catalog change. The audit
-- reads published rows by age through outbox_events_published_idx.
do $$
begin
  if not exists (select from information_schema.columns
                  where table_schema = current_schema()
                    and table_name = 'outbox_events'
                    and column_name = 'published_stream') then
    alter table outbox_events
      add column published_stream text   null,
      add column published_seq    bigint null;
  end if;
end
$$;
