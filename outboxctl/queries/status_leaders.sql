-- `outboxctl status`: the leaders of ordered consumers (inbox_leases): who took
-- each consumer's leadership last, its fencing epoch, and whether it let go.
select consumer as "consumer!", holder as "holder!", epoch as "epoch!",
       case when isfinite(acquired_at) then acquired_at end as "acquired_at?",
       released as "released!"
  from inbox_leases
 order by consumer
