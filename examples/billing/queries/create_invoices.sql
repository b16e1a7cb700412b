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
