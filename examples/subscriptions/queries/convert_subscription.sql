update subscriptions
   set converted_at = now()
 where id = $1
