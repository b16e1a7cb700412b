-- Idempotent, like every file here (see 20260101000001_outbox_events.sql),
-- and run under the migration lock.
select pg_advisory_xact_lock(1868721409, 0);

-- Consumers isolated from each other in one database.
--
-- Every consumer of a database shares the four inbox tables, keyed by the
-- column `consumer` (its JetStream durable name), and every consumer's login
-- role is a member of outbox_consumer (ops/sql/roles.sql), which may read and
-- write all of them. Without more, one consumer's role could make another
-- skip an event (insert its inbox row), apply one twice (delete its row),
-- stall it (bump its lease epoch, which fences every transaction of its
-- leader) or read what it handled. So each consumer name has an owner role,
-- and row-level security lets a session see and write only the rows of the
-- consumers whose owner it is a member of (pg_has_role(…, 'MEMBER'): the
-- owner itself, or a group role granted to it).
--
-- - inbox_consumers.owner: the role that owns the consumer name. A row is
--   recorded by the consumer runtime at start (inbox_consumer::Consumer::new,
--   where the consumer stands on its stream), a new one owned by the role it
--   runs under (`default current_user`): the first registration claims the
--   name. A runtime that finds its name owned by a role it is not a member
--   of refuses to start, naming the consumer, the owner and its own role
--   (the row itself is hidden from it; inbox_consumer_owner, below, names
--   the owner). The operator
--   may claim a name beforehand, or hand it to another role (several
--   replicas under different login roles: a group role granted to each), as
--   the owner of the schema: `outboxctl inbox set-owner <consumer> <role>`,
--   or `update inbox_consumers set owner = '<role>' where consumer = '<c>'`.
--   Rows recorded before this file ran are owned by the role that ran it.
--   A consumer role cannot change the owner of its own row: roles.sql grants
--   UPDATE of the position columns only.
-- - The policies: inbox_events, inbox_dead_letters and inbox_leases rows are
--   visible and writable only for a consumer the session's role owns;
--   inbox_consumers rows only when the role owns them. An insert of another
--   consumer's row, an update or delete of one (a lease epoch bump: insert …
--   on conflict do update) fail with SQLSTATE 42501 ("new row violates
--   row-level security policy", or the row is simply not there to delete).
-- - Who is not subject to them: the tables' owner (who ran the migrations;
--   row security is enabled, not forced), superusers and BYPASSRLS roles:
--   migrations, outboxctl and tests, which read every consumer's rows.
-- - A name that is not registered has no visible rows: until its runtime has
--   recorded it, a consumer's role reads nothing and writes nothing of it.
--   The rows an earlier build wrote become visible to the owner once the
--   runtime registers the name at its next start.
-- - An owner role that does not exist (dropped) matches no session: its
--   rows are then the operator's alone (`outboxctl inbox set-owner`).
--
-- The cost: each statement on one of these tables evaluates, once, which
-- consumers the session owns (the subquery below is uncorrelated, so the
-- planner runs it once per statement, as a hashed subplan, whatever the
-- number of rows), then compares each row's `consumer` against that set.
-- That subquery reads inbox_consumers (one row per consumer) and asks
-- pg_has_role, from the role membership cache, of each row's owner only, not
-- of every role of the cluster. A batch of 64 inbox rows pays it once.
--
-- Advisory locks (an ordered consumer's leadership, its fence, its subject
-- locks) are not rows: any role may take them. A standby of an ordered
-- consumer that cannot get the lead for longer than its lease timeout looks
-- up who holds its leader lock (pg_locks, pg_stat_activity) and logs an
-- error naming that session's role and pid when the role does not own the
-- consumer (inbox_consumer::runtime, "Consumers sharing a database").

do $$
begin
  -- Added with a stable default, so existing rows take the migrating role
  -- without a rewrite of the table.
  if not exists (select from information_schema.columns
                  where table_schema = current_schema()
                    and table_name = 'inbox_consumers'
                    and column_name = 'owner') then
    alter table inbox_consumers
      add column owner name not null default current_user;
  end if;
end
$$;

-- Who owns a consumer name, for the refusal of a runtime that does not own it
-- (the policies hide the row itself from it). Reveals the owner's role name
-- and nothing else of the row. SECURITY DEFINER, so it reads as the tables'
-- owner, with a search_path fixed to this schema (pg_temp last) so that no
-- caller's objects stand in for the table. EXECUTE is granted to
-- outbox_consumer by roles.sql, not to PUBLIC.
do $$
begin
  execute format(
    $f$
    create or replace function inbox_consumer_owner(consumer_name text) returns name
    language sql stable security definer
    set search_path = %I, pg_temp
    as 'select owner from inbox_consumers where consumer = consumer_name'
    $f$,
    current_schema());
end
$$;

revoke all on function inbox_consumer_owner(text) from public;

-- Row security, and one policy per table. Each step is checked first, so that
-- running this again takes no lock on a table that has them already.
do $$
declare
  t text;
  -- The consumer names the session's role owns. An owner that is no role
  -- any more matches nothing: to_regrole gives null for it (pg_has_role on
  -- a missing name would fail the statement instead), and so does
  -- pg_has_role then.
  owned constant text :=
    'select c.consumer from inbox_consumers c
      where pg_has_role(current_user, to_regrole(quote_ident(c.owner)), ''MEMBER'')';
begin
  foreach t in array array['inbox_events', 'inbox_dead_letters', 'inbox_leases', 'inbox_consumers'] loop
    if not (select relrowsecurity from pg_class
             where relnamespace = current_schema()::regnamespace
               and relname = t) then
      execute format('alter table %I enable row level security', t);
    end if;
  end loop;

  foreach t in array array['inbox_events', 'inbox_dead_letters', 'inbox_leases'] loop
    if not exists (select from pg_policies
                    where schemaname = current_schema()
                      and tablename = t
                      and policyname = t || '_by_owner') then
      execute format(
        'create policy %I on %I for all using (consumer in (%s)) with check (consumer in (%s))',
        t || '_by_owner', t, owned, owned);
    end if;
  end loop;

  if not exists (select from pg_policies
                  where schemaname = current_schema()
                    and tablename = 'inbox_consumers'
                    and policyname = 'inbox_consumers_by_owner') then
    create policy inbox_consumers_by_owner on inbox_consumers for all
      using (pg_has_role(current_user, to_regrole(quote_ident(owner)), 'MEMBER'))
      with check (pg_has_role(current_user, to_regrole(quote_ident(owner)), 'MEMBER'));
  end if;
end
$$;
