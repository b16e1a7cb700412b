//! `subscription.created` → one invoice and an `invoice.created` event.

use inbox_consumer::{Handler, HandlerError};
use outbox_pg::{Envelope, Outbox};
use sqlx::PgTransaction;
use uuid::Uuid;

use crate::events::{InvoiceCreated, SOURCE, SubscriptionCreated};

const INSERT: &str = include_str!("../../queries/insert_invoice.sql");

/// Raises one invoice per `subscription.created`, and writes `invoice.created`
/// (subject: the subscription) through the outbox in the same transaction.
///
/// The insert happens under the subscription's lock (held until commit), so a
/// cancellation handled at the same moment on another replica waits for this
/// transaction and then sees its invoice ([`VoidInvoices`](crate::VoidInvoices)).
///
/// Nothing in the handler or the `invoices` table prevents a second invoice
/// for the same subscription: the inbox row, committed in the same
/// transaction, is what makes a redelivery a no-op.
#[derive(Debug, Clone)]
pub struct InvoiceSubscription {
    outbox: Outbox,
}

impl InvoiceSubscription {
    /// A handler writing its follow-on events through `outbox`.
    pub fn new(outbox: Outbox) -> Self {
        Self { outbox }
    }
}

impl Handler for InvoiceSubscription {
    type Message = SubscriptionCreated;

    async fn handle(
        &self,
        event: Envelope<SubscriptionCreated>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        let data = event.data();
        // The subscription's lock and the insert, in one statement.
        let invoice_id = Uuid::now_v7();
        sqlx::query(INSERT)
            .bind(invoice_id)
            .bind(&data.subscription_id)
            .bind(&data.customer_id)
            .bind(data.amount_cents)
            .bind(event.id().as_uuid())
            .execute(&mut **tx)
            .await?;
        let invoice = Envelope::event(
            SOURCE,
            data.subscription_id.clone(),
            InvoiceCreated {
                invoice_id: invoice_id.to_string(),
                subscription_id: data.subscription_id.clone(),
                customer_id: data.customer_id.clone(),
                amount_cents: data.amount_cents,
            },
        )?;
        self.outbox.enqueue(tx, &invoice).await?;
        tracing::debug!(
            %invoice_id, subscription_id = %data.subscription_id, customer_id = %data.customer_id,
            event_id = %event.id(), "invoice raised",
        );
        Ok(())
    }
}
