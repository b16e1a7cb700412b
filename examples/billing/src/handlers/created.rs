//! `subscription.created` → one invoice and an `invoice.created` event each,
//! a batch's creations in two statements.

use inbox_consumer::{BatchHandler, HandlerError};
use outbox_pg::{Envelope, Outbox};
use sqlx::PgTransaction;
use uuid::Uuid;

use crate::events::{InvoiceCreated, SOURCE, SubscriptionCreated};

const INSERT: &str = include_str!("../../queries/insert_invoices.sql");

/// Raises one invoice per `subscription.created`, and writes `invoice.created`
/// (subject: the subscription) through the outbox in the same transaction.
///
/// A [`BatchHandler`]: the creations of a batch are raised together, one
/// insert of every invoice and one outbox write of every `invoice.created`,
/// whatever the batch's size (a delivery handled alone is a group of one).
///
/// Each `invoice.created` carries its subscription event's trace context, so
/// it stays in the writer's trace although the group runs in the batch's span.
///
/// The insert takes each subscription's lock (held until commit) before it
/// writes any row, so a cancellation handled at the same moment on another
/// replica waits for this transaction and then sees its invoice
/// ([`VoidInvoices`](crate::VoidInvoices)).
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

impl BatchHandler for InvoiceSubscription {
    type Message = SubscriptionCreated;

    async fn handle_batch(
        &self,
        events: Vec<Envelope<SubscriptionCreated>>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        let count = events.len();
        let mut ids = Vec::with_capacity(count);
        let mut subscriptions = Vec::with_capacity(count);
        let mut customers = Vec::with_capacity(count);
        let mut amounts = Vec::with_capacity(count);
        let mut event_ids = Vec::with_capacity(count);
        let mut invoices = Vec::with_capacity(count);
        for event in &events {
            let data = event.data();
            let invoice_id = Uuid::now_v7();
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
            // In its subscription's trace, not the batch's.
            invoices.push(match event.traceparent() {
                Some(parent) => invoice
                    .with_trace_context(parent.to_owned(), event.tracestate().map(str::to_owned)),
                None => invoice,
            });
            ids.push(invoice_id);
            subscriptions.push(data.subscription_id.clone());
            customers.push(data.customer_id.clone());
            amounts.push(data.amount_cents);
            event_ids.push(*event.id().as_uuid());
        }
        sqlx::query(INSERT)
            .bind(&ids)
            .bind(&subscriptions)
            .bind(&customers)
            .bind(&amounts)
            .bind(&event_ids)
            .execute(&mut **tx)
            .await?;
        self.outbox.enqueue_all(tx, &invoices).await?;
        for (event, invoice_id) in events.iter().zip(&ids) {
            tracing::debug!(
                %invoice_id, subscription_id = %event.data().subscription_id,
                customer_id = %event.data().customer_id, event_id = %event.id(), "invoice raised",
            );
        }
        Ok(())
    }
}
