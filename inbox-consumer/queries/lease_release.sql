-- Gives up leadership at a clean shutdown, once every held message is acked:
-- records that it let go cleanly, then unlocks.
with released as (
  update inbox_leases set released = true where consumer = $1 and epoch = $2
)
select pg_advisory_unlock(hashtext('inbox_consumer.leader'), hashtext($1))
