-- The tables of $1 (those the session sees) whose row-level security applies
-- to the session: it is neither their owner nor a superuser (nor BYPASSRLS),
-- so it reads only the rows its policies let it (the inbox's: the consumers
-- its role owns). And the session's role.
select t as "table!", current_user::text as "role!"
  from unnest($1::text[]) as t
 where to_regclass(t) is not null
   and row_security_active(to_regclass(t))
