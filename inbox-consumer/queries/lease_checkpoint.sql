-- The takeover checkpoint the last leader of a consumer recorded: every
-- message it has to handle at or below checkpoint_seq is finished, except the
-- stream sequences in checkpoint_pending. Null: none recorded.
select checkpoint_seq, checkpoint_pending from inbox_leases where consumer = $1
