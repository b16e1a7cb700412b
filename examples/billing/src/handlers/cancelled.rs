//! `subscription.cancelled` → the subscription's invoice voided.

use std::time::Duration;

use inbox_consumer::{Handler, HandlerError};
use outbox_pg::Envelope;
use sqlx::PgTransaction;

use crate::events::SubscriptionCancelled;

const VOID: &str = include_str!("../../queries/void_invoices.sql");

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
/// share a subject (the subscription). With the consumer's ordered mode (the
/// `billing` default) they are handled one after the other in stream order,
/// whichever replica holds them. Without it — or if the creation was
/// dead-lettered and replayed by hand later — the cancellation can come first,
/// and this handler must stay right under any interleaving with a creation
/// running on another replica:
///
/// 1. it takes the subscription's lock, which [`InvoiceSubscription`]
///    holds from before its insert until its commit, so a creation in flight
///    is waited for, never seen half-way;
/// 2. one statement voids the invoice and tells whether one exists, from one
///    snapshot.
///
/// No invoice yet: the cancellation asks to be retried after
/// [`CANCEL_RETRY_AFTER`] (the contract's rule 3), its transaction and inbox
/// row rolled back; once the invoice exists the retry voids it. An invoice
/// already voided: nothing to do.
///
/// [`InvoiceSubscription`]: crate::InvoiceSubscription
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
        super::lock_subscription(tx, subscription_id).await?;
        let (voided, invoiced): (i64, bool) = sqlx::query_as(VOID)
            .bind(subscription_id)
            .fetch_one(&mut **tx)
            .await?;
        if voided > 0 {
            tracing::info!(%subscription_id, voided, event_id = %event.id(), "invoice voided");
            return Ok(());
        }
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
