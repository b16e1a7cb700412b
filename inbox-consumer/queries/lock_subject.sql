-- Serialises the transactions of one consumer on one subject, across every
-- replica, until commit or rollback. A transaction-scoped advisory lock in its
-- own two-key space (class `inbox_consumer.subject`), so it never meets an
-- application's single-key advisory locks. A hash collision only serialises
-- two unrelated subjects.
select pg_advisory_xact_lock(hashtext('inbox_consumer.subject'), hashtext($1 || '/' || $2))
