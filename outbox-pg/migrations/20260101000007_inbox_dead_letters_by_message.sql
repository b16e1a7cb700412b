-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- A message is dead-lettered once per consumer. When the Term that follows a
-- committed dead letter is lost, JetStream redelivers the message and the
-- runtime dead-letters it again; the insert then finds the row it wrote
-- before (same consumer, stream, stream sequence and bytes) through this
-- index and returns it instead of writing a second one. Not unique: tables
-- written before this migration may hold such doubles already, and a stream
-- deleted and created again under the same name numbers its messages from 1
-- again, so the sequence alone does not name a message.
do $$
begin
  if not exists (select from pg_indexes
                  where schemaname = current_schema()
                    and indexname = 'inbox_dead_letters_message_idx') then
    create index inbox_dead_letters_message_idx
      on inbox_dead_letters (consumer, stream, stream_sequence);
  end if;
end
$$;
