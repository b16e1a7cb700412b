-- The server's WAL insert position, in bytes from 0/0: every transaction
-- committed before this statement ends below it.
select (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint as "lsn!"
