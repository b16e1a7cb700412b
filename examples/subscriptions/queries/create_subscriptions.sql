create table if not exists subscriptions (
    id           text        primary key,
    customer_id  text        not null,
    plan         text        not null,
    amount_cents bigint      not null check (amount_cents >= 0),
    status       text        not null default 'active' check (status in ('active', 'cancelled')),
    created_at   timestamptz not null default now()
);
-- Trials. A subscription created with a trial has its end (trial_ends_at) and
-- the id of its scheduled `subscription.trial_ended` (trial_event_id), written
-- in the creating transaction; converting it to paid before then cancels
-- that event, by this id, in the transaction that sets converted_at.
alter table subscriptions
    add column if not exists trial_ends_at  timestamptz null,
    add column if not exists trial_event_id uuid        null,
    add column if not exists converted_at   timestamptz null;
