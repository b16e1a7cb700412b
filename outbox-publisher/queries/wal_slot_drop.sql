-- Drops replication slot $1 (it must not be in use).
select pg_drop_replication_slot($1)
