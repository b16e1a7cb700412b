//! `subscription.cancelled` → the subscription's invoice voided.

use std::time::Duration;

use inbox_consumer::{Handler, HandlerError};
use outbox_core::Envelope;
use sqlx::PgTransaction;

use crate::events::SubscriptionCancelled;

const VOID: &str = include_str!("../../queries/void_invoices.sql");
const EXISTS: &str = include_str!("../../queries/invoice_exists.sql");

/// How long a cancellation waits before it is tried again when its
/// subscription has no invoice yet.
pub const CANCEL_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The cancellation arrived before the creation was applied (it may be
/// waiting for a retry, or in flight at another replica).
#[derive(Debug, thiserror::Error)]
#[error("subscription `{subscription_id}` has no invoice yet; the cancellation waits for it")]
pub struct NotInvoicedYet {
    /// The subscription cancelled.
    pub subscription_id: String,
}

/// Voids a cancelled subscription's invoice.
///
/// Order matters here: a cancellation applied before the invoice exists would
/// void nothing and the invoice raised afterwards would stay valid. The events
/// share a subject (the subscription), so they normally arrive in order; when they
/// do not — the creation failed once and waits for its retry, or went to the
/// other replica — the cancellation finds no invoice and asks to be retried
/// after [`CANCEL_RETRY_AFTER`] (the contract's rule 3), its transaction and inbox
/// row rolled back. Once the invoice exists the retry voids it. A cancellation
/// of an invoice already voided does nothing.
#[derive(Debug, Clone, Default)]
pub struct VoidInvoices {
    _private: (),
}

impl VoidInvoices {
    /// The handler.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Handler for VoidInvoices {
    type Message = SubscriptionCancelled;

    async fn handle(
        &self,
        event: Envelope<SubscriptionCancelled>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        let subscription_id = &event.data().subscription_id;
        let voided = sqlx::query(VOID)
            .bind(subscription_id)
            .execute(&mut **tx)
            .await?
            .rows_affected();
        if voided > 0 {
            tracing::info!(%subscription_id, voided, event_id = %event.id(), "invoice voided");
            return Ok(());
        }
        let invoiced: bool = sqlx::query_scalar(EXISTS)
            .bind(subscription_id)
            .fetch_one(&mut **tx)
            .await?;
        if invoiced {
            tracing::debug!(%subscription_id, "invoice already voided");
            Ok(())
        } else {
            Err(HandlerError::retry(NotInvoicedYet {
                subscription_id: subscription_id.clone(),
            })
            .retry_after(CANCEL_RETRY_AFTER))
        }
    }
}
