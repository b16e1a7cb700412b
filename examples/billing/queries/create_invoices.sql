-- subscription_id is deliberately NOT unique: nothing in the schema stops a
-- second invoice for a subscription. Only the inbox (one row per consumer and
-- event id, committed with the invoice) keeps redeliveries from billing twice,
-- so a chaos run without it shows up as double invoices.
create table if not exists invoices (
    id              uuid        primary key,
    subscription_id text        not null,
    customer_id     text        not null,
    amount_cents    bigint      not null,
    event_id        uuid        not null,
    created_at      timestamptz not null default clock_timestamp(),
    voided_at       timestamptz null
);
create index if not exists invoices_subscription_id on invoices (subscription_id);
-- One row per trial that ran out before its subscription was converted to
-- paid (subscription.trial_ended): billing charges the subscription from the
-- trial's end. As with invoices, subscription_id is deliberately NOT unique:
-- only the inbox keeps a redelivered trial end from being recorded twice.
create table if not exists trial_ends (
    id              uuid        primary key,
    subscription_id text        not null,
    customer_id     text        not null,
    trial_ended_at  timestamptz not null,
    event_id        uuid        not null,
    recorded_at     timestamptz not null default clock_timestamp()
);
create index if not exists trial_ends_subscription_id on trial_ends (subscription_id);
