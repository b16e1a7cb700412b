select id, customer_id, plan, amount_cents, status, created_at
  from subscriptions
 where id = $1
