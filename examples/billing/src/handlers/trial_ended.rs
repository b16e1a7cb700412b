//! `subscription.trial_ended` → the trial's end recorded: billing charges the
//! subscription from then on.

use inbox_consumer::{Handler, HandlerError};
use outbox_pg::Envelope;
use sqlx::PgTransaction;
use uuid::Uuid;

use crate::events::SubscriptionTrialEnded;

const INSERT: &str = include_str!("../../queries/insert_trial_end.sql");

/// Records the end of a trial that ran out unconverted, one `trial_ends` row
/// per event.
///
/// The event is scheduled by the subscriptions service at the trial's end
/// and cancelled if the customer converts (or cancels) first, so billing
/// hears only of trials that did run out. It carries no `sequence` and is in
/// no order with its subscription's other events; the handler depends on
/// none of them. Nothing in `trial_ends` prevents a second row for a
/// subscription: the inbox row, committed in the same transaction, makes a
/// redelivery a no-op.
#[derive(Debug, Clone, Default)]
pub struct RecordTrialEnd {
    _private: (),
}

impl RecordTrialEnd {
    /// The handler.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Handler for RecordTrialEnd {
    type Message = SubscriptionTrialEnded;

    async fn handle(
        &self,
        event: Envelope<SubscriptionTrialEnded>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        let data = event.data();
        sqlx::query(INSERT)
            .bind(Uuid::now_v7())
            .bind(&data.subscription_id)
            .bind(&data.customer_id)
            .bind(data.trial_ended_at)
            .bind(event.id().as_uuid())
            .execute(&mut **tx)
            .await?;
        tracing::info!(
            subscription_id = %data.subscription_id, customer_id = %data.customer_id,
            trial_ended_at = %data.trial_ended_at, event_id = %event.id(),
            "trial ended; charging from its end",
        );
        Ok(())
    }
}
