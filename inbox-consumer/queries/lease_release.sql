-- Gives up leadership at a clean shutdown, once every held message is acked.
select pg_advisory_unlock(hashtext('inbox_consumer.leader'), hashtext($1))
