-- Raises an invoice under its subscription's lock, in one statement: the CTE
-- takes the lock (see lock_subscription.sql: same key space, held until the
-- transaction ends) before the row is inserted, so a cancellation handled at
-- the same moment on another replica waits for this transaction and then
-- sees the invoice.
with locked as (
  select pg_advisory_xact_lock(hashtext('billing.invoices'), hashtext($2))
)
insert into invoices (id, subscription_id, customer_id, amount_cents, event_id)
select $1, $2, $3, $4, $5
  from locked
