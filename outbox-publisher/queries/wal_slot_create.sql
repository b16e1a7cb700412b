-- Creates logical replication slot $1 with pgoutput; decoding starts at the
-- returned position (every transaction committing after it).
select lsn::text as "lsn?" from pg_create_logical_replication_slot($1, 'pgoutput')
