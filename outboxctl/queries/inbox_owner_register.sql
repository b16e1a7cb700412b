-- Claims consumer $1's name for role $2 before its runtime first starts,
-- recording the stream $3 it will read. Nothing if the name was registered
-- meanwhile.
insert into inbox_consumers (consumer, stream, owner)
values ($1, $3, $2)
on conflict (consumer) do nothing
