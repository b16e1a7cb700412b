create table if not exists subscriptions (
    id           text        primary key,
    customer_id  text        not null,
    plan         text        not null,
    amount_cents bigint      not null check (amount_cents >= 0),
    status       text        not null default 'active' check (status in ('active', 'cancelled')),
    created_at   timestamptz not null default now()
)
