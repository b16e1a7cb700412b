-- A dead letter was published again (its PubAck received): count it.
update inbox_dead_letters
   set replay_count = replay_count + 1,
       replayed_at = now()
 where id = $1
returning replay_count, replayed_at as "replayed_at!"
