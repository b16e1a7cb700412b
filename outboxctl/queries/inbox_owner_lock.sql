-- The consumer's owner, its row locked until the change commits.
select owner::text as "owner!" from inbox_consumers where consumer = $1 for update
