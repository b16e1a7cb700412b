-- Which of the (table, column) pairs the search_path does not find: a table
-- not found names itself alone, a column of a table found names both.
--   $1 tables, $2 columns (element by element; a NULL column: the table alone)
select coalesce(array_agg(distinct case when to_regclass(r.tbl) is null then r.tbl
                                        else r.tbl || '.' || r.col end
                          order by case when to_regclass(r.tbl) is null then r.tbl
                                        else r.tbl || '.' || r.col end), '{}') as "missing!"
  from unnest($1::text[], $2::text[]) as r(tbl, col)
 where to_regclass(r.tbl) is null
    or (r.col is not null
        and not exists (select 1 from pg_attribute a
                         where a.attrelid = to_regclass(r.tbl)
                           and a.attname = r.col and not a.attisdropped))
