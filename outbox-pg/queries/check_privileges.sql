-- Start-up privilege check: for each (object, kind, privilege), whether the
-- current role holds it. An object not found through the search_path (not
-- migrated yet, or in a schema the role may not use) comes back with granted
-- null: the caller reports missing tables elsewhere.
--   $1 objects, $2 kinds ('table', 'a column of table' or 'sequence'),
--   $3 privileges (SELECT, …)
select current_user::text as "role!",
       r.object as "object!",
       r.kind as "kind!",
       r.privilege as "privilege!",
       case when to_regclass(r.object) is null then null
            when r.kind = 'sequence' then has_sequence_privilege(to_regclass(r.object), r.privilege)
            when r.kind = 'a column of table' then has_any_column_privilege(to_regclass(r.object), r.privilege)
            else has_table_privilege(to_regclass(r.object), r.privilege)
       end as "granted?"
  from unnest($1::text[], $2::text[], $3::text[]) with ordinality as r(object, kind, privilege, n)
 order by r.n
