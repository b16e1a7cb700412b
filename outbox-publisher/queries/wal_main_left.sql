-- Whether a main-lane row (fresh: neither published nor in the retry lane) at
-- or below seq $1 is still waiting: the WAL source's backfill through the
-- polling path is done when none is (and the horizon has passed $1).
select exists (select 1
                 from outbox_events
                where published_at is null
                  and next_attempt_at is null
                  and seq <= $1) as "left!"
