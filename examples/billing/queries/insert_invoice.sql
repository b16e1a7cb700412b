insert into invoices (id, subscription_id, customer_id, amount_cents, event_id)
values ($1, $2, $3, $4, $5)
