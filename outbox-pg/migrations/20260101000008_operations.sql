-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- Operator actions, recorded on the rows they act on.
--
-- outbox_events: a row an operator abandoned (`outboxctl skip`), so that the
-- rows of its subject behind it move on. A skipped row is kept, never
-- deleted by retention and never reported as published: published_at stays
-- null, next_attempt_at is 'infinity' (out of both of the relay's lanes), and
-- these columns say who skipped it, when and why. The relay's queries pass
-- over it when they look for an earlier row of the subject.
--
-- inbox_dead_letters: how often a dead letter was put back in front of its
-- consumer (`outboxctl dead-letters replay`), and when last.
--
-- Every column is nullable or has a constant default, so adding it rewrites
-- nothing and holds the table's lock only for the catalog change.
do $$
begin
  if not exists (select from information_schema.columns
                  where table_schema = current_schema()
                    and table_name = 'outbox_events'
                    and column_name = 'skipped_at') then
    alter table outbox_events
      add column skipped_at  timestamptz null,
      add column skipped_by  text        null,
      add column skip_reason text        null;
  end if;

  if not exists (select from information_schema.columns
                  where table_schema = current_schema()
                    and table_name = 'inbox_dead_letters'
                    and column_name = 'replay_count') then
    alter table inbox_dead_letters
      add column replay_count int         not null default 0,
      add column replayed_at  timestamptz null;
  end if;
end
$$;
