-- A runtime of the consumer stopped (another replica's next write clears it).
update inbox_consumers set stopped_at = now() where consumer = $1
