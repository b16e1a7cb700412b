//! The inbox: tower middleware that handles each event exactly once in effect,
//! and a JetStream consumer runtime that acks only after the effect commits.
//!
//! The outbox delivers at least once, so a consumer sees duplicates as part of
//! ordinary operation. This crate makes the contract's consumer rules a
//! framework: a service implements a [`Handler`] per event type, stacks
//! layers with tower, and gets one effect per event without writing dedupe code.
//!
//! # Getting started
//!
//! A [`Handler`] per event type, and [`Consumer::builder`]: it assembles the
//! standard stack ([`TraceLayer`] → [`MetricsLayer`] → [`DedupeLayer`] →
//! [`Router`]), subscribes the durable to the handlers' event types only,
//! waits for the stream to exist, and consumes until shutdown.
//!
//! ```no_run
//! use inbox_consumer::prelude::*;
//! use serde::{Deserialize, Serialize};
//! use sqlx::PgTransaction;
//!
//! #[derive(Serialize, Deserialize, JsonSchema)]
//! struct SubscriptionCreated { subscription_id: String, plan: String }
//!
//! impl Event for SubscriptionCreated {
//!     const TYPE: &'static str = "subscription.created";
//! }
//!
//! #[derive(Clone)]
//! struct OpenAccount;
//!
//! impl Handler for OpenAccount {
//!     type Message = SubscriptionCreated;
//!     async fn handle(
//!         &self,
//!         event: Envelope<SubscriptionCreated>,
//!         tx: &mut PgTransaction<'static>,
//!     ) -> Result<(), HandlerError> {
//!         sqlx::query("insert into accounts (subscription_id, plan) values ($1, $2)")
//!             .bind(&event.data().subscription_id)
//!             .bind(&event.data().plan)
//!             .execute(&mut **tx)
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://localhost/billing").await?;
//! outbox_pg::migrate(&pool).await?; // inbox_events, inbox_dead_letters
//! let nats = async_nats::connect("nats://localhost:4222").await?;
//!
//! Consumer::builder(pool, nats, "SUBSCRIPTIONS", "billing")
//!     .handler(OpenAccount)
//!     .configure(|config| config.concurrency(16))
//!     .run(inbox_consumer::shutdown_signal()) // SIGTERM or ctrl-c, then drains
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! The same, assembled by hand, for a stack of your own:
//!
//! ```no_run
//! # use inbox_consumer::prelude::*;
//! # use serde::{Deserialize, Serialize};
//! # #[derive(Serialize, Deserialize, JsonSchema)]
//! # struct SubscriptionCreated { subscription_id: String }
//! # impl Event for SubscriptionCreated { const TYPE: &'static str = "subscription.created"; }
//! # #[derive(Clone)]
//! # struct OpenAccount;
//! # impl Handler for OpenAccount {
//! #     type Message = SubscriptionCreated;
//! #     async fn handle(&self, _: Envelope<SubscriptionCreated>, _: &mut sqlx::PgTransaction<'static>) -> Result<(), HandlerError> { Ok(()) }
//! # }
//! use inbox_consumer::{DedupeLayer, MetricsLayer, TraceLayer};
//! use tower::ServiceBuilder;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let pool = sqlx::PgPool::connect("postgres://localhost/billing").await?;
//! # let js = async_nats::jetstream::new(async_nats::connect("nats://localhost:4222").await?);
//! let router = Router::new().handler(OpenAccount);
//! // Subscribe to what you handle: the router's event types.
//! let config = ConsumerConfig::for_router("SUBSCRIPTIONS", "billing", &router).concurrency(16);
//! let service = ServiceBuilder::new()
//!     .layer(TraceLayer::new())   // span per delivery, linked to the publisher's trace
//!     .layer(MetricsLayer::new()) // handled / failed counters, latency histogram
//!     .layer(DedupeLayer::new(pool.clone())) // begin, inbox row, commit
//!     .service(router);
//!
//! let consumer = Consumer::new_when_ready(pool, js, config, None).await?;
//! consumer.run(service, inbox_consumer::shutdown_signal()).await?; // SIGTERM or ctrl-c
//! # Ok(()) }
//! ```
//!
//! # Guarantees
//!
//! - **One effect per event per consumer.** The inbox row `(consumer, event id)`
//!   is inserted with `ON CONFLICT DO NOTHING` in the handler's own transaction
//!   ([`dedupe`]); a duplicate skips the handler and is acked, counted
//!   (`inbox_duplicates_total`) and logged at `info`. No in-memory seen-set.
//! - **Ack after commit.** The runtime acks only once the transaction has
//!   committed; a failed commit or handler error is never acked ([`runtime`]).
//! - **Nothing lost, whatever the outage.** The broker's delivery limit is
//!   unlimited and the runtime counts its own budget; a database that cannot
//!   be reached never turns an event into a dead letter, and a dead letter
//!   that cannot be written is retried ([`runtime`]).
//! - **Bounded waits.** Every transaction runs with lock, statement and
//!   idle-in-transaction timeouts ([`Timeouts`]).
//! - **Batches** of deliveries in one transaction ([`Consumer::run_batched`],
//!   the [builder](Consumer::builder)'s default), and set-based handlers that
//!   get a batch's events of their type in one call ([`BatchHandler`]).
//! - **Consume → produce.** A handler enqueues follow-on events with
//!   [`outbox_pg::Outbox::enqueue`] on the same transaction: effect, inbox row
//!   and event commit together or not at all.
//! - **Poison is dead-lettered**, with raw bytes, headers and a reason
//!   ([`dead_letter`]), then terminated; never a crash loop, never a silent drop.
//! - **Per-subject order** within a process; across every replica with
//!   [`ConsumerConfig::ordered`] (one leader, fenced commits, failover: see
//!   [`runtime`](runtime#ordered-consumption)); and a race-free stale-event
//!   filter for order-dependent handlers that compares the events' insert
//!   order (`sequence`), not their clocks ([`ordering`]).
//! - **Retention** of inbox rows is checked against the redelivery window at
//!   start-up ([`retention`]); dead letters are pruned too, on a longer window
//!   (30 days).
//!
//! # Layers
//!
//! Outermost first: [`TraceLayer`] → [`MetricsLayer`] → (a tower timeout, if
//! wanted: it drops the transaction, which rolls back) → [`DedupeLayer`] →
//! ([`Router`] / [`SkipStaleLayer`]) → [`HandlerService`]. Layers outside dedupe
//! are `Service<Delivery>`; those inside are `Service<InTx<Delivery>>` and hand
//! the transaction back.
//!
//! With the [builder](Consumer::builder), a layer of your own goes in with
//! [`ConsumerBuilder::layer`]: it wraps each handler inside the transaction
//! (`Service<InTx<Delivery>>`), whichever types are routed, with no stack to
//! rebuild. [`ConsumerBuilder::batch_layer`] takes a layer that also wraps a
//! [`BatchHandler`]'s group call, so its batches stay whole.
//!
//! In a batch, [`Dedupe`] hands a [`BatchHandler`] its events together only
//! through a service that states it keeps groups ([`GroupBatching`]: a
//! [`Router`]); for the batched mode, the service under the dedupe says
//! either way, and one that says nothing goes under [`Ungrouped`], the
//! explicit one-at-a-time fallback.
//!
//! # Features
//!
//! - `connect` (off): `inbox_consumer::connect`, re-exported from
//!   `outbox_pg::connect`: the `--database-url`/`--nats-*` flags with
//!   secrets from env or files, TLS, and shutdown on a signal, for a consumer
//!   binary. Add a sqlx TLS backend to the binary for PostgreSQL TLS.
//! - `opentelemetry` (off): [`TraceLayer`] sets each `inbox.delivery` span's
//!   OpenTelemetry parent to the writer's span named by the message's
//!   `traceparent` (through `tracing-opentelemetry`), so a handler's spans
//!   are in the writer's trace; turns on `outbox-pg/opentelemetry`, so the
//!   events a handler enqueues carry that trace on. See [`trace`].
//!
//! Metrics (through the `metrics` facade, a no-op without a recorder;
//! see [`metrics`], lag gauges included) and tracing are always compiled in,
//! as is [`Readiness`], the checks for a readiness probe (database, NATS,
//! stream, durable consumer).
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(warnings))))]

mod batch_handler;
mod builder;
pub mod dead_letter;
pub mod dedupe;
mod delivery;
mod error;
mod fence;
mod grouping;
/// The user guide's chapter on consuming, rendered here from the
/// repository's `docs/`.
pub mod guide {
    #[doc = include_str!("../docs/consuming.md")]
    pub mod consuming {}
}
mod handler;
mod header_block;
mod health;
pub mod metrics;
pub mod ordering;
mod poison;
pub mod pool;
pub mod prelude;
pub mod retention;
mod retry;
mod router;
pub mod runtime;
mod service;
pub mod trace;

pub use batch_handler::BatchHandler;
pub use builder::{ConsumerBuilder, IntoJetStream};
pub use dedupe::{Dedupe, DedupeLayer, Timeouts};
pub use delivery::{
    BatchResults, Deliveries, Delivery, DeliveryInfo, InTx, Outcome, TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
};
pub use error::{Action, BoxError, Error, ErrorKind, HandlerError, Result};
pub use grouping::{GroupBatching, GroupRoute, Ungrouped};
pub use handler::Handler;
pub use health::{DEFAULT_CHECK_TIMEOUT, Readiness};
pub use metrics::{Metrics, MetricsLayer};
pub use ordering::{SkipStale, SkipStaleLayer};
#[cfg(feature = "connect")]
pub use outbox_pg::connect;
/// Resolves on SIGTERM or ctrl-c: the shutdown future for
/// [`Consumer::run`](runtime::Consumer::run) in a container or a terminal.
pub use outbox_pg::shutdown_signal;
pub use poison::{Poison, Reason};
pub use retention::Retention;
pub use retry::RetryPolicy;
pub use router::{Routable, Route, Router, TxRoute};
pub use runtime::{Consumer, ConsumerConfig, Start, Unrouted};
pub use service::{BatchHandlerService, HandlerService, typed};
pub use trace::{Trace, TraceLayer};

/// The crate README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
