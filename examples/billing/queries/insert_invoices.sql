-- Raises the invoices of a group of subscriptions, in one statement, each under
-- its subscription's lock (see lock_subscription.sql: same key space, held
-- until the transaction ends), so a cancellation handled at the same moment
-- on another replica waits for this transaction and then sees the invoice.
-- The locks are taken first (the CTE is evaluated before any row is
-- inserted: it calls a volatile function, so it is materialised, and the
-- insert reads its count), in the order of their keys, so two transactions
-- raising overlapping groups never wait for each other crosswise.
-- $1 invoice ids, $2 subscription ids, $3 customer ids, $4 amounts, $5 event
-- ids: one element per invoice.
with locked as (
  select pg_advisory_xact_lock(hashtext('billing.invoices'), k.key)
    from (select distinct hashtext(s) as key from unnest($2::text[]) s order by 1) k
)
insert into invoices (id, subscription_id, customer_id, amount_cents, event_id)
select i.id, i.subscription_id, i.customer_id, i.amount_cents, i.event_id
  from unnest($1::uuid[], $2::text[], $3::text[], $4::int8[], $5::uuid[])
         as i (id, subscription_id, customer_id, amount_cents, event_id)
 cross join (select count(*) from locked) l
