-- Least-privilege roles for the outbox and the inbox.
--
-- Run by the schema owner (the role that ran the migrations), after them, in
-- each database, with the search_path the services use (the grants are made
-- on the objects of current_schema()):
--
--   psql "$OWNER_DATABASE_URL" --single-transaction -v ON_ERROR_STOP=1 -f ops/sql/roles.sql
--
-- Rerunnable: the roles are created only when missing (they are cluster-wide,
-- so a second database finds them), and GRANT of a privilege held already
-- changes nothing. Run it again after every migration: table-level grants
-- cover columns added later, but not tables or sequences added later.
--
-- Three NOLOGIN group roles, each granted exactly what one component uses:
--
--   outbox_writer    a service that enqueues events in its transactions
--                    (outbox_pg::Outbox::enqueue, schedule): INSERT on
--                    outbox_events, USAGE on outbox_events_seq (the insert
--                    trigger calls nextval() as the inserting role); to
--                    cancel scheduled events (Outbox::cancel), SELECT on the
--                    scheduling columns and UPDATE of cancelled_at and
--                    cancelled_by.
--   outbox_relay     outbox-relay, or a relay run in-process: SELECT, UPDATE
--                    (claims, marks, backoff) and DELETE (retention) on
--                    outbox_events (retention's row locks are covered by
--                    UPDATE); SELECT on outbox_events_seq (the settled
--                    horizon reads last_value); SELECT, INSERT, UPDATE,
--                    DELETE on outbox_relay_slots (the WAL source's record
--                    of its slot's backfill). Advisory locks, pg_locks and
--                    LISTEN need no grant.
--   outbox_consumer  an inbox consumer: SELECT, INSERT, DELETE (retention) on
--                    inbox_events and inbox_dead_letters, and UPDATE of one
--                    column of each (handled_at, created_at: the retention's
--                    FOR UPDATE SKIP LOCKED row locks need UPDATE on some
--                    column; no statement updates either), USAGE on
--                    inbox_dead_letters_id_seq; SELECT, INSERT, UPDATE on
--                    inbox_leases (ordered consumers); SELECT, INSERT on
--                    inbox_consumers (the runtime registers its consumer at
--                    start) and UPDATE of where it stands on its stream
--                    (stream, filter_subjects, ack_floor, updated_at), never
--                    of its name or owner; EXECUTE on inbox_consumer_owner
--                    (the owner of a name, for the runtime's refusal).
--
-- Consumers are kept apart by row-level security, not by grants
-- (migration 20260101000013_inbox_isolation.sql): every consumer's role is a
-- member of outbox_consumer, and sees and writes only the inbox rows, dead
-- letters, lease and inbox_consumers row of the consumers whose name it owns
-- (inbox_consumers.owner: it, or a role granted to it). The first
-- registration of a name claims it for the role the runtime runs under, so
-- claim a name before its consumer first starts when another consumer's
-- role could start first, and give a consumer whose replicas log in as
-- several roles a group role of its own:
--
--   create role billing_consumers nologin;
--   grant billing_consumers to billing_login, billing_login_2;
--   outboxctl inbox set-owner billing billing_consumers   -- as the owner
--   -- or: update inbox_consumers set owner = 'billing_consumers' where consumer = 'billing';
--
-- Never make outbox_consumer itself (of which every consumer's role is a
-- member) the owner of a name. The tables' owner and superusers are not
-- subject to row security: run migrations and outboxctl as the owner.
--
-- Each may also read outbox_schema_migrations, so outbox_pg::migrate at
-- start-up can see the schema is up to date and change nothing. None may
-- create, alter or drop anything: migrations run as the owner.
--
-- Login roles are the operator's, made members of what they run:
--
--   create role relay_login login password '…';
--   grant outbox_relay to relay_login;
--   grant outbox_writer, outbox_consumer, outbox_relay to billing_login;  -- consumes, enqueues, relays in-process
--   grant outbox_consumer to shipping_login;                -- another consumer, kept apart
--
-- A service's own tables (invoices, subscriptions, …) are granted by the
-- service's operator the same way; docs/security.md has the whole sequence
-- (outboxctl migrate, this file, the logins) as it runs. A role missing a privilege is refused at
-- start-up with an error naming the role, the privilege and the table.

select pg_advisory_xact_lock(1868721409, 0); -- outbox_pg::MIGRATION_LOCK: not during a migration

do $$
declare
  r text;
begin
  foreach r in array array['outbox_writer', 'outbox_relay', 'outbox_consumer'] loop
    if not exists (select from pg_roles where rolname = r) then
      begin
        execute format('create role %I nologin', r);
      exception when duplicate_object or unique_violation then
        null; -- created meanwhile by another database's run
      end;
    end if;
  end loop;
end
$$;

do $$
declare
  s text := current_schema();
begin
  if s is null then
    raise exception 'no schema on the search_path: set it to the schema the services use';
  end if;
  execute format('grant usage on schema %I to outbox_writer, outbox_relay, outbox_consumer', s);
end
$$;

-- The history table exists where outbox_pg::migrate ran (not where only
-- psql or a service's own tool applied the files).
do $$
begin
  if to_regclass('outbox_schema_migrations') is not null then
    grant select on outbox_schema_migrations to outbox_writer, outbox_relay, outbox_consumer;
  end if;
end
$$;

-- outbox_writer
grant insert on outbox_events to outbox_writer;
grant usage on sequence outbox_events_seq to outbox_writer;
-- Cancelling a scheduled event (outbox_pg::Outbox::cancel): the columns
-- that say whether it may still be cancelled, never a payload, and the two
-- a cancel writes.
grant select (id, due_at, published_at, released_at, cancelled_at),
      update (cancelled_at, cancelled_by)
   on outbox_events to outbox_writer;

-- outbox_relay
grant select, update, delete on outbox_events to outbox_relay;
grant select on sequence outbox_events_seq to outbox_relay;
-- The WAL source's record of its slot's backfill (outbox-relay --source wal),
-- where the migrations made it (20260101000017).
do $$
begin
  if to_regclass('outbox_relay_slots') is not null then
    grant select, insert, update, delete on outbox_relay_slots to outbox_relay;
  end if;
end
$$;

-- outbox_consumer
grant select, insert, delete on inbox_events to outbox_consumer;
grant update (handled_at) on inbox_events to outbox_consumer;
grant select, insert, delete on inbox_dead_letters to outbox_consumer;
grant update (created_at) on inbox_dead_letters to outbox_consumer;
grant usage on sequence inbox_dead_letters_id_seq to outbox_consumer;
-- (UPDATE covers the takeover checkpoint columns, 20260101000014.)
grant select, insert, update on inbox_leases to outbox_consumer;
-- inbox_consumers: UPDATE of where the consumer stands only, never of its
-- name or owner (granted on the table by an earlier version of this file).
grant select, insert on inbox_consumers to outbox_consumer;
revoke update on inbox_consumers from outbox_consumer;
grant update (stream, filter_subjects, ack_floor, updated_at, stopped_at) on inbox_consumers to outbox_consumer;
grant execute on function inbox_consumer_owner(text) to outbox_consumer;
