//! The one trait a service implements per event type.

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

/// Handles one event type a group at a time: every event of the type that a
/// batch brings, in one call, inside the batch's transaction.
///
/// A [`Handler`] is called once per event, so a batch of 64 deliveries runs
/// its statements 64 times. A `BatchHandler` gets the events of its type in
/// the batch together and can apply them set-based: one `insert … select
/// from unnest(…)`, one [`Outbox::enqueue_all`](outbox_pg::Outbox::enqueue_all).
/// Route it with [`Router::batch_handler`](crate::Router::batch_handler).
///
/// What a call gets and what its result means:
///
/// - `events` are fresh (their inbox rows were written in this transaction:
///   duplicates never reach it), of distinct subjects (a batch holds one
///   delivery per subject), in stream order; at least one.
/// - `Ok` commits every event's effects with the inbox rows of the batch.
/// - An error rolls the whole batch back, whatever it is. When the call held
///   one event, its [`Action`](crate::Action) decides, as for a
///   [`Handler`]; when it held several, the runtime handles each of the
///   batch's deliveries again alone (this handler then gets one event), so
///   the failure is pinned on the event that causes it and the others are
///   applied once.
/// - Outside a batch ([`Consumer::run`](crate::Consumer::run), or a delivery
///   retried alone), every call holds one event.
///
/// A group is handled only when the [`Dedupe`](crate::Dedupe) of the batch
/// wraps the [`Router`](crate::Router) directly, as
/// [`Consumer::builder`](crate::Consumer::builder) builds it; with another
/// service between them each event is handled by the route's one-event
/// service (the same handler, a group of one), one at a time.
///
/// The call runs in the batch's span, not in each delivery's: follow-on
/// events written through the outbox without a trace context of their own
/// carry the batch's (whose span links every writer's). To keep a follow-on
/// event in its cause's trace, give it the event's context
/// (`follow_on.with_trace_context(event.traceparent()…)`, as `billing`
/// does). Panics are caught as for a [`Handler`].
///
/// ```
/// use inbox_consumer::{BatchHandler, HandlerError};
/// use outbox_pg::Envelope;
/// use serde::Deserialize;
/// use sqlx::PgTransaction;
///
/// # #[allow(dead_code)]
/// #[derive(Deserialize)]
/// struct SubscriptionCreated { subscription_id: String, plan: String }
///
/// #[derive(Clone)]
/// struct OpenAccounts;
/// # let _ = OpenAccounts;
///
/// impl BatchHandler for OpenAccounts {
///     type Message = SubscriptionCreated;
///
///     async fn handle_batch(
///         &self,
///         events: Vec<Envelope<SubscriptionCreated>>,
///         tx: &mut PgTransaction<'static>,
///     ) -> Result<(), HandlerError> {
///         let (ids, plans): (Vec<String>, Vec<String>) = events
///             .iter()
///             .map(|e| (e.data().subscription_id.clone(), e.data().plan.clone()))
///             .unzip();
///         sqlx::query(
///             "insert into accounts (subscription_id, plan) \
///              select * from unnest($1::text[], $2::text[])",
///         )
///         .bind(&ids)
///         .bind(&plans)
///         .execute(&mut **tx)
///         .await?;
///         Ok(())
///     }
/// }
/// ```
pub trait BatchHandler: Clone + Send + Sync + 'static {
    /// The payload type; `data` that does not decode as it is dead-lettered
    /// (found when the event is handled alone).
    type Message: DeserializeOwned + Send + 'static;

    /// Applies `events` (see the [trait docs](BatchHandler)).
    fn handle_batch(
        &self,
        events: Vec<Envelope<Self::Message>>,
        tx: &mut PgTransaction<'static>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}
