-- Records a trial's end: from trial_ended_at the subscription is charged.
-- $1 row id, $2 subscription, $3 customer, $4 the trial's end, $5 event id.
insert into trial_ends (id, subscription_id, customer_id, trial_ended_at, event_id)
values ($1, $2, $3, $4, $5)
