//! The handlers, one per event type.

mod cancelled;
mod created;
mod trial_ended;

pub use cancelled::{CANCEL_RETRY_AFTER, NotInvoicedYet, VoidInvoices};
pub use created::InvoiceSubscription;
pub use trial_ended::RecordTrialEnd;

const LOCK_SUBSCRIPTION: &str = include_str!("../../queries/lock_subscription.sql");

/// Takes the lock on `subscription_id`'s invoices, held until `tx` ends.
async fn lock_subscription(
    tx: &mut sqlx::PgTransaction<'static>,
    subscription_id: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(LOCK_SUBSCRIPTION)
        .bind(subscription_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
