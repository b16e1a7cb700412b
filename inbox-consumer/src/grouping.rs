//! Group batching, as a property a service states: [`GroupBatching`].
//!
//! In a batch ([`Consumer::run_batched`](crate::Consumer::run_batched)),
//! [`Dedupe`](crate::Dedupe) can hand a [`BatchHandler`](crate::BatchHandler)
//! every fresh event of its type at once, in one call: a *group*. Only the
//! service right under the dedupe knows whether that is sound (a layer that
//! acts on each delivery would be passed by), so it says so:
//! `Dedupe<S>` serves a batch only when `S: GroupBatching`, and asks
//! [`group_route`](GroupBatching::group_route) for each event type where a
//! group may go. A stack whose inner service states nothing does not compile
//! for the batched mode; it never loses its groups silently.
//!
//! | service under the dedupe | groups |
//! | --- | --- |
//! | [`Router`](crate::Router) (inside the transaction) | each type routed to a [`BatchHandler`](crate::BatchHandler), unless a [`Router::layer`](crate::Router::layer) dropped it ([`Router::batch_layer`](crate::Router::batch_layer) keeps it) |
//! | [`SkipStale`](crate::SkipStale) | none: each delivery is checked, then handled, on its own |
//! | [`HandlerService`](crate::HandlerService), [`BatchHandlerService`](crate::BatchHandlerService) | none: one delivery at a time (a group of one) |
//! | [`Ungrouped`] around any other service (a tower layer, a boxed route, a `service_fn`) | none, chosen explicitly |
//!
//! A layer of your own between the dedupe and a router either forwards its
//! inner service's groups (when it need not see each delivery: a group call
//! passes it by) or states none; one that states nothing goes under
//! [`Ungrouped`].

use std::task::{Context, Poll};

use tower::Service;
use tower::util::BoxCloneSyncService;

use crate::delivery::{Delivery, InTx};
use crate::error::BoxError;

/// A route for a whole group of one event type, in the batch's transaction:
/// what [`Router::batch_layer`](crate::Router::batch_layer) wraps beside each
/// [`TxRoute`](crate::TxRoute).
pub type GroupRoute = BoxCloneSyncService<InTx<Vec<Delivery>>, InTx<()>, BoxError>;

/// A service inside the inbox transaction that says where a batch may hand
/// several deliveries of one event type to a single call. See the
/// [module docs](self).
pub trait GroupBatching {
    /// The route a batch's fresh deliveries of `event_type` go to together,
    /// in one call, at the place of the first of them; `None` when each goes
    /// through this service on its own.
    fn group_route(&self, event_type: &str) -> Option<&GroupRoute>;
}

/// Any service, stated to keep no groups: under a
/// [`Dedupe`](crate::Dedupe) in a batch, each delivery goes through it on its
/// own, whatever it wraps (a router's groups included). The explicit
/// fallback for a service that does not implement [`GroupBatching`].
///
/// ```no_run
/// use std::time::Duration;
/// use inbox_consumer::prelude::*;
/// use inbox_consumer::{DedupeLayer, InTx, Ungrouped};
/// use tower::ServiceBuilder;
/// use tower::timeout::TimeoutLayer;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let pool = sqlx::PgPool::connect("postgres://localhost/billing").await?;
/// # let js = async_nats::jetstream::new(async_nats::connect("nats://localhost:4222").await?);
/// let router: Router<InTx<Delivery>, InTx<Outcome>> = Router::new();
/// let config = ConsumerConfig::for_router("SUBSCRIPTIONS", "billing", &router);
/// // A timeout around the whole router sees every delivery: no BatchHandler
/// // gets a group through it, and `Ungrouped` says so (without it, the
/// // stack does not compile for `run_batched`).
/// let service = ServiceBuilder::new()
///     .layer(DedupeLayer::new(pool.clone()))
///     .layer_fn(Ungrouped::new)
///     .layer(TimeoutLayer::new(Duration::from_secs(10)))
///     .service(router);
/// let consumer = Consumer::new(pool, js, config).await?;
/// consumer.run_batched(service, inbox_consumer::shutdown_signal()).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Ungrouped<S> {
    inner: S,
}

impl<S> Ungrouped<S> {
    /// Wraps `inner`.
    pub const fn new(inner: S) -> Self {
        Self { inner }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S> GroupBatching for Ungrouped<S> {
    fn group_route(&self, _event_type: &str) -> Option<&GroupRoute> {
        None
    }
}

impl<S, R> Service<R> for Ungrouped<S>
where
    S: Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> S::Future {
        self.inner.call(request)
    }
}
