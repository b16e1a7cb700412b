-- Whether this session may use the consumer's rows: row security shows it the
-- consumer's inbox_consumers row only when its role is a member of the
-- owner (or when it is not subject to row security: the tables' owner, a
-- superuser). And the role, for the refusal.
select exists (select from inbox_consumers where consumer = $1) as "visible!",
       current_user::text as "role!"
