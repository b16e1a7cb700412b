-- $5: the trial's length in milliseconds, or NULL for no trial. Its end is
-- reckoned from the transaction's start, by the database's clock (the clock
-- that decides when the scheduled event falls due).
insert into subscriptions (id, customer_id, plan, amount_cents, trial_ends_at, trial_event_id)
values ($1, $2, $3, $4, now() + $5::bigint * interval '1 millisecond', $6)
returning trial_ends_at
