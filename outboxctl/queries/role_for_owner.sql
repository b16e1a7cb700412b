-- Whether role $1 exists, and whether every member of outbox_consumer (every
-- consumer's role, ops/sql/roles.sql) would be a member of it: such a role
-- owning a name would share the consumer with all of them.
select exists (select from pg_roles where rolname = $1)         as "exists!",
       coalesce((select pg_has_role(g.oid, r.oid, 'MEMBER')
                   from pg_roles g, pg_roles r
                  where g.rolname = 'outbox_consumer' and r.rolname = $1), false) as "shared!"
