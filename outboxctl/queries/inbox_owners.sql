-- Every registered consumer (or the one named by $1): who owns its name,
-- whether that role exists, and what it reads.
select c.consumer                                             as "consumer!",
       c.owner::text                                          as "owner!",
       exists (select from pg_roles r where r.rolname = c.owner) as "owner_exists!",
       c.stream                                               as "stream!",
       c.filter_subjects                                      as "filter_subjects!",
       c.created_at                                           as "created_at!"
  from inbox_consumers c
 where $1::text is null or c.consumer = $1::text
 order by c.consumer
