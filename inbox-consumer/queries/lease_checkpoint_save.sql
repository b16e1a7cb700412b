-- Records a leader's takeover checkpoint (see lease_checkpoint.sql), only while
-- its epoch is current: a deposed leader's checkpoint is true but older.
update inbox_leases
   set checkpoint_seq = $3, checkpoint_pending = $4
 where consumer = $1 and epoch = $2
