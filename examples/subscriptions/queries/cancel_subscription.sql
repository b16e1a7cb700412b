update subscriptions
   set status = 'cancelled'
 where id = $1
   and status = 'active'
returning customer_id, trial_event_id, converted_at
