select exists (select 1 from invoices where subscription_id = $1)
