-- Which of the columns $2 of tables $1 (pairwise) a table the session sees
-- lacks, as `table.column`. Tables it does not see are another check's.
select x.t || '.' || x.c as "column!"
  from unnest($1::text[], $2::text[]) as x(t, c)
 where to_regclass(x.t) is not null
   and not exists (select from pg_attribute a
                    where a.attrelid = to_regclass(x.t)
                      and a.attname = x.c
                      and a.attnum > 0
                      and not a.attisdropped)
