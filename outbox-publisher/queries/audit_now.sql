-- The database's clock, which set published_at: an audit pass measures the
-- rows' age by it, not by the relay host's clock.
select now() as "now!"
