-- The subscription a conversion is asked for, locked until the transaction
-- ends: a cancellation or another conversion of it waits.
select status, trial_event_id, converted_at
  from subscriptions
 where id = $1
   for update
