//! [`BatchHandler`]: a handler that takes the events of its type in a batch
//! together, set-based ([`Handler`](crate::Handler) takes one at a time).

use std::future::Future;

use outbox_pg::Envelope;
use serde::de::DeserializeOwned;
use sqlx::PgTransaction;

use crate::error::HandlerError;

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
///
/// [`Handler`]: crate::Handler
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
