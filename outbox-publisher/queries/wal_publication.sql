-- Whether publication $1 exists, and whether it carries $2.outbox_events.
select exists (select 1 from pg_publication where pubname = $1) as "exists!",
       exists (select 1 from pg_publication_tables
                where pubname = $1 and schemaname = $2 and tablename = 'outbox_events') as "has_table!"
