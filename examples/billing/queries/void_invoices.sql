-- Voids a subscription's invoice and tells, from the same snapshot, whether it
-- has one at all. One statement, so the decision ("no invoice yet: retry" or
-- "already voided: done") and the act see the same rows: a creation that
-- commits while this runs is invisible to both parts, never to one only.
with voided as (
  update invoices
     set voided_at = clock_timestamp()
   where subscription_id = $1
     and voided_at is null
  returning 1
)
select (select count(*) from voided)                              as voided,
       exists (select 1 from invoices where subscription_id = $1) as invoiced
