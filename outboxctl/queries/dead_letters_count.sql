-- How many dead letters the same filters as dead_letters_list.sql match.
select count(*) as "total!"
  from inbox_dead_letters
 where ($1::text is null or consumer = $1::text)
   and ($2::text is null or reason = $2::text)
