insert into subscriptions (id, customer_id, plan, amount_cents)
values ($1, $2, $3, $4)
