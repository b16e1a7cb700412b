-- Fails (SQLSTATE 25P02) when a statement in the transaction failed: COMMIT of
-- an aborted transaction reports success while rolling back, so it must not
-- be reached.
select 1 as ok
