-- Who owns the consumer name (through inbox_consumer_owner, a SECURITY DEFINER
-- function: row security hides the row itself from a role that does not own
-- it), and whether that role still exists.
select o.owner::text as "owner?",
       exists (select from pg_roles r where r.rolname = o.owner) as "exists!"
  from (select inbox_consumer_owner($1) as owner) o
