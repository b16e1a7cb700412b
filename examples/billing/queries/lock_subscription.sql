-- Serialises the transactions that touch one subscription's invoices, across
-- every billing replica: raising an invoice and voiding it take this lock
-- first and hold it until commit. A transaction-scoped advisory lock in its own
-- two-key space (class `invoices`, key the subscription), so it never meets the
-- application's other advisory locks. A hash collision only serialises two
-- unrelated subscriptions.
select pg_advisory_xact_lock(hashtext('billing.invoices'), hashtext($1))
