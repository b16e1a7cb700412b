-- For the rest of the transaction: no JIT compilation. The claim's plan is
-- estimated expensive on a large table (a lateral per shard), which crosses
-- jit_above_cost, and compiling it takes far longer (~0.8 s) than running it
-- (a few ms).
select set_config('jit', 'off', true)
