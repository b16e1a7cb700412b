//! The schema files other languages read are the ones derived from the event
//! types: a change to either side without the other fails here. Rewrite the
//! files from the types with `UPDATE_SCHEMAS=1 cargo test -p example-subscriptions --test schemas`.

use example_subscriptions::default_schemas_dir;
use example_subscriptions::events::{
    SubscriptionCancelled, SubscriptionCreated, SubscriptionTrialEnded,
};
use outbox_pg::check_schema_file;

#[test]
fn subscription_created_matches_its_schema_file() {
    check_schema_file::<SubscriptionCreated>(default_schemas_dir()).unwrap();
}

#[test]
fn subscription_cancelled_matches_its_schema_file() {
    check_schema_file::<SubscriptionCancelled>(default_schemas_dir()).unwrap();
}

#[test]
fn subscription_trial_ended_matches_its_schema_file() {
    check_schema_file::<SubscriptionTrialEnded>(default_schemas_dir()).unwrap();
}
