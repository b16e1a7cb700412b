update subscriptions
   set status = 'cancelled'
 where id = $1
   and status = 'active'
returning customer_id
