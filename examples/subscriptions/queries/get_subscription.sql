select id, customer_id, plan, amount_cents, status, created_at,
       trial_ends_at, trial_event_id, converted_at
  from subscriptions
 where id = $1
