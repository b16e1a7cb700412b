-- `outboxctl prune`: the cutoff, by the server's clock. $1 window (ms)
select now() - $1::bigint * interval '1 millisecond' as "cutoff!"
