-- Bounds for an operator's transaction on a table running relays use: wait
-- at most this long for a row lock or a statement (this transaction only).
select set_config('lock_timeout', '10s', true) as "lock_timeout!",
       set_config('statement_timeout', '60s', true) as "statement_timeout!"
