-- Which of $1 (table names) the session cannot see on its search_path.
select t as "table!"
  from unnest($1::text[]) as t
 where to_regclass(t) is null
