-- Who holds the consumer's leader lock (the keys of lease_try_lock.sql), and
-- whether that session's role owns the consumer (is a member of the owner
-- recorded in inbox_consumers). Any role may take an advisory lock, so a
-- standby that cannot get the lead looks here. pg_stat_activity shows every
-- session's pid and role to every role.
-- The first key names the schema holding the inbox (nothing for `public`,
-- `:<schema>` otherwise; see outbox_pg::Namespace), so consumers of inboxes
-- in other schemas of the database, even under the same name, never meet.
select l.pid                                                as "pid!",
       a.usename::text                                      as "role?",
       a.application_name                                   as "application?",
       c.owner::text                                        as "owner?",
       coalesce(pg_has_role(a.usesysid, r.oid, 'MEMBER'), false) as "owns!"
  from pg_locks l
  join pg_stat_activity a on a.pid = l.pid
  left join inbox_consumers c on c.consumer = $1
  left join pg_roles r on r.rolname = c.owner
 where l.locktype = 'advisory'
   and l.granted
   and l.objsubid = 2
   and l.database = (select oid from pg_database where datname = current_database())
   and l.classid = hashtext(
         'inbox_consumer.leader'
         || coalesce((select case when n.nspname = 'public' then '' else ':' || n.nspname end
                        from pg_class pc
                        join pg_namespace n on n.oid = pc.relnamespace
                       where pc.oid = to_regclass('inbox_events')), ''))::oid
   and l.objid = hashtext($1)::oid
