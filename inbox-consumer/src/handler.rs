//! The one trait a service implements per event type ([`BatchHandler`](crate::BatchHandler)
//! is its set-based twin).

use std::future::Future;

use outbox_pg::Envelope;
use serde::de::DeserializeOwned;
use sqlx::PgTransaction;

use crate::error::HandlerError;

/// Handles one event type, inside the transaction its inbox row commits in.
///
/// Everything the handler changes goes through `tx`: its own tables, and any
/// follow-on events through [`outbox_pg::Outbox::enqueue`], which takes the
/// same transaction. [`HandlerService`](crate::HandlerService) makes a
/// `Handler` a tower service; [`Dedupe`](crate::dedupe::Dedupe) begins and
/// commits the transaction around it. A handler never commits, never acks,
/// and never does outside work (email, HTTP) that cannot roll back: write the
/// intent to a table instead.
///
/// A handler that panics (an `unwrap` on a field, an index out of range)
/// fails its event, not the consumer: the runtime catches the panic, the
/// transaction rolls back, the event is retried like a retryable error and
/// dead-lettered with reason `panic` once its budget is spent (see
/// [`runtime`](crate::runtime#a-panicking-handler)). Only the transaction is
/// undone, so state the handler keeps outside it (shared between its clones)
/// must not be left half-updated where it may panic. Return a
/// [`HandlerError`] rather than panic where the failure is foreseen.
///
/// ```
/// use inbox_consumer::{Handler, HandlerError};
/// use outbox_pg::Envelope;
/// use serde::Deserialize;
/// use sqlx::PgTransaction;
///
/// # #[allow(dead_code)]
/// #[derive(Deserialize)]
/// struct SubscriptionCreated { subscription_id: String, plan: String }
///
/// #[derive(Clone)]
/// struct OpenAccount;
/// # let _ = OpenAccount;
///
/// impl Handler for OpenAccount {
///     type Message = SubscriptionCreated;
///
///     async fn handle(
///         &self,
///         event: Envelope<SubscriptionCreated>,
///         tx: &mut PgTransaction<'static>,
///     ) -> Result<(), HandlerError> {
///         if event.data().plan.is_empty() {
///             return Err(HandlerError::reject("a subscription needs a plan"));
///         }
///         sqlx::query("insert into accounts (subscription_id, plan) values ($1, $2)")
///             .bind(&event.data().subscription_id)
///             .bind(&event.data().plan)
///             .execute(&mut **tx)
///             .await?; // a database error means retry
///         Ok(())
///     }
/// }
/// ```
pub trait Handler: Clone + Send + Sync + 'static {
    /// The payload type; `data` that does not decode as it is dead-lettered.
    type Message: DeserializeOwned + Send + 'static;

    /// Applies `event`. Returning `Ok` commits the effects with the inbox row;
    /// an error rolls everything back and its [`Action`](crate::Action) decides
    /// between redelivery and the dead-letter table.
    fn handle(
        &self,
        event: Envelope<Self::Message>,
        tx: &mut PgTransaction<'static>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}
