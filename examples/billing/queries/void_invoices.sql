update invoices
   set voided_at = clock_timestamp()
 where subscription_id = $1
   and voided_at is null
