//! [`Router`]: one process, several event types, one handler stack each.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceExt};

use outbox_pg::Event;

use crate::batch_handler::BatchHandler;
use crate::delivery::{Delivery, InTx, Outcome};
use crate::error::{BoxError, Error, ErrorKind, HandlerError};
use crate::grouping::{GroupBatching, GroupRoute};
use crate::handler::Handler;
use crate::service::{BatchHandlerService, HandlerService};

/// A request that names its event type.
pub trait Routable {
    /// The event type to route on.
    fn event_type(&self) -> &str;
}

impl Routable for Delivery {
    fn event_type(&self) -> &str {
        Delivery::event_type(self).as_str()
    }
}

impl Routable for InTx<Delivery> {
    fn event_type(&self) -> &str {
        self.get_ref().event_type().as_str()
    }
}

/// A route: the service one event type's requests go to.
pub type Route<Req, Resp> = BoxCloneSyncService<Req, Resp, BoxError>;

/// A route inside the inbox transaction, as [`ConsumerBuilder`](crate::ConsumerBuilder)
/// builds them: what [`Router::layer`] wraps there.
pub type TxRoute = Route<InTx<Delivery>, InTx<Outcome>>;

/// Boxes `service` as a route, its error boxed.
fn boxed<Req, S>(service: S) -> BoxCloneSyncService<Req, S::Response, BoxError>
where
    Req: 'static,
    S: Service<Req> + Clone + Send + Sync + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    BoxCloneSyncService::new(service.map_err(Into::into))
}

/// The group routes of a router, by event type.
type Groups = Arc<HashMap<String, GroupRoute>>;

/// Routes requests by event type; cheap to clone.
///
/// A router dispatches on the envelope's event type. It works at either level
/// of the stack:
///
/// - inside [`Dedupe`](crate::dedupe::Dedupe), as a `Service<InTx<Delivery>>`
///   routing to [`HandlerService`](crate::HandlerService)s: one transaction
///   and one inbox row per delivery, whatever the type;
/// - outside it, as a `Service<Delivery>` routing to whole stacks, when types
///   need different layers.
///
/// An event type with no route fails with [`ErrorKind::Unroutable`], a reject:
/// the runtime dead-letters it as `unroutable` rather than dropping it. Use the
/// consumer's filter subjects to receive only the routed types.
///
/// Each consumer name is its own dedupe namespace: two consumers (two durables,
/// or two runtimes with different names) each handle every event once.
///
/// A type routed to a [`BatchHandler`] ([`batch_handler`](Self::batch_handler))
/// also has a group route ([`GroupBatching`]): a batch's
/// [`Dedupe`](crate::dedupe::Dedupe) wrapping this router hands it every
/// event of the type in the batch at once.
pub struct Router<Req, Resp> {
    routes: Arc<HashMap<String, Route<Req, Resp>>>,
    groups: Groups,
}

impl<Req, Resp> Clone for Router<Req, Resp> {
    fn clone(&self) -> Self {
        Self {
            routes: Arc::clone(&self.routes),
            groups: Arc::clone(&self.groups),
        }
    }
}

impl<Req, Resp> Default for Router<Req, Resp> {
    fn default() -> Self {
        Self {
            routes: Arc::new(HashMap::new()),
            groups: Arc::new(HashMap::new()),
        }
    }
}

impl<Req, Resp> fmt::Debug for Router<Req, Resp> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut types: Vec<&str> = self.routes.keys().map(String::as_str).collect();
        types.sort_unstable();
        f.debug_struct("Router")
            .field("event_types", &types)
            .finish()
    }
}

impl<Req, Resp> Router<Req, Resp>
where
    Req: Send + 'static,
    Resp: Send + 'static,
{
    /// A router with no routes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Routes `event_type` to `service`, replacing an earlier route for it.
    #[must_use]
    pub fn route<S>(mut self, event_type: impl Into<String>, service: S) -> Self
    where
        S: Service<Req, Response = Resp> + Clone + Send + Sync + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
    {
        let service = boxed(service);
        let event_type = event_type.into();
        // Copy-on-write: a clone of the router keeps its own routes.
        if self.groups.contains_key(&event_type) {
            Arc::make_mut(&mut self.groups).remove(&event_type);
        }
        Arc::make_mut(&mut self.routes).insert(event_type, service);
        self
    }

    /// Routes the event type `E` ([`Event::TYPE`]) to `service`: the same as
    /// [`route`](Self::route) without writing the type string.
    #[must_use]
    pub fn route_event<E, S>(self, service: S) -> Self
    where
        E: Event,
        S: Service<Req, Response = Resp> + Clone + Send + Sync + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
    {
        self.route(E::TYPE, service)
    }

    /// Wraps every route in `layer`: each delivery passes through it on its
    /// way to its event type's service, as with
    /// [`axum::Router::layer`](https://docs.rs/axum/latest/axum/struct.Router.html#method.layer).
    /// Routes added afterwards are not wrapped.
    ///
    /// A type routed to a [`BatchHandler`] loses its group route here (a
    /// layer written for one delivery cannot wrap a group): in a batch, its
    /// events then reach the handler one at a time, each a group of one. To
    /// keep the groups, use [`batch_layer`](Router::batch_layer) with a layer
    /// that serves both requests (tower's `TimeoutLayer`,
    /// `ConcurrencyLimitLayer` and the like do).
    ///
    /// ```
    /// use std::time::Duration;
    /// use inbox_consumer::prelude::*;
    /// # use serde::{Deserialize, Serialize};
    /// # #[derive(Serialize, Deserialize, JsonSchema)]
    /// # struct InvoicePaid { invoice_id: String }
    /// # impl Event for InvoicePaid { const TYPE: &'static str = "invoice.paid"; }
    /// # #[derive(Clone)]
    /// # struct MarkPaid;
    /// # impl Handler for MarkPaid {
    /// #     type Message = InvoicePaid;
    /// #     async fn handle(&self, _: Envelope<InvoicePaid>, _: &mut sqlx::PgTransaction<'static>) -> Result<(), HandlerError> { Ok(()) }
    /// # }
    /// // Each handler gets at most 10 s; a slower one fails its delivery
    /// // (rolled back, retried with backoff).
    /// let router = Router::new()
    ///     .handler(MarkPaid)
    ///     .layer(tower::timeout::TimeoutLayer::new(Duration::from_secs(10)));
    /// assert_eq!(router.event_types(), ["invoice.paid"]);
    /// ```
    #[must_use]
    pub fn layer<L>(self, layer: L) -> Self
    where
        L: Layer<Route<Req, Resp>>,
        L::Service: Service<Req, Response = Resp> + Clone + Send + Sync + 'static,
        <L::Service as Service<Req>>::Error: Into<BoxError>,
        <L::Service as Service<Req>>::Future: Send + 'static,
    {
        let routes = self
            .routes
            .iter()
            .map(|(event_type, route)| (event_type.clone(), boxed(layer.layer(route.clone()))))
            .collect();
        Self {
            routes: Arc::new(routes),
            groups: Arc::new(HashMap::new()),
        }
    }

    /// The routed event types, sorted: the filter subjects a consumer needs.
    pub fn event_types(&self) -> Vec<String> {
        let mut types: Vec<String> = self.routes.keys().cloned().collect();
        types.sort_unstable();
        types
    }
}

impl Router<InTx<Delivery>, InTx<Outcome>> {
    /// Routes `handler`'s message type to it, inside the transaction: the
    /// event type is the message's [`Event::TYPE`], the service a
    /// [`HandlerService`].
    ///
    /// ```
    /// use inbox_consumer::prelude::*;
    /// # use serde::{Deserialize, Serialize};
    /// # #[derive(Serialize, Deserialize, JsonSchema)]
    /// # struct InvoicePaid { invoice_id: String }
    /// # impl Event for InvoicePaid { const TYPE: &'static str = "invoice.paid"; }
    /// # #[derive(Clone)]
    /// # struct MarkPaid;
    /// # impl Handler for MarkPaid {
    /// #     type Message = InvoicePaid;
    /// #     async fn handle(&self, _: Envelope<InvoicePaid>, _: &mut sqlx::PgTransaction<'static>) -> Result<(), HandlerError> { Ok(()) }
    /// # }
    /// let router = Router::new().handler(MarkPaid);
    /// assert_eq!(router.event_types(), ["invoice.paid"]);
    /// ```
    #[must_use]
    pub fn handler<H>(self, handler: H) -> Self
    where
        H: Handler,
        H::Message: Event,
    {
        self.route(<H::Message as Event>::TYPE, HandlerService::new(handler))
    }

    /// Routes `handler`'s message type to a [`BatchHandler`]: in a batch
    /// ([`Consumer::run_batched`](crate::Consumer::run_batched), the
    /// [builder](crate::Consumer::builder)'s default) it gets every event of
    /// the type in the batch in one call; alone, a group of one.
    ///
    /// ```
    /// use inbox_consumer::prelude::*;
    /// # use serde::{Deserialize, Serialize};
    /// # #[derive(Serialize, Deserialize, JsonSchema)]
    /// # struct InvoicePaid { invoice_id: String }
    /// # impl Event for InvoicePaid { const TYPE: &'static str = "invoice.paid"; }
    /// # #[derive(Clone)]
    /// # struct MarkPaid;
    /// # impl BatchHandler for MarkPaid {
    /// #     type Message = InvoicePaid;
    /// #     async fn handle_batch(&self, _: Vec<Envelope<InvoicePaid>>, _: &mut sqlx::PgTransaction<'static>) -> Result<(), HandlerError> { Ok(()) }
    /// # }
    /// let router = Router::new().batch_handler(MarkPaid);
    /// assert_eq!(router.event_types(), ["invoice.paid"]);
    /// ```
    #[must_use]
    pub fn batch_handler<H>(self, handler: H) -> Self
    where
        H: BatchHandler,
        H::Message: Event,
    {
        self.route_batch_handler(<H::Message as Event>::TYPE, handler)
    }

    /// [`batch_handler`](Self::batch_handler) for `event_type`, whatever the
    /// message type (one without [`Event`], or several types decoded alike),
    /// replacing an earlier route for it.
    #[must_use]
    pub fn route_batch_handler<H: BatchHandler>(
        self,
        event_type: impl Into<String>,
        handler: H,
    ) -> Self {
        let event_type = event_type.into();
        let mut router = self.route(
            event_type.clone(),
            BatchHandlerService::new(handler.clone()),
        );
        let group: GroupRoute = boxed(BatchHandlerService::new(handler));
        Arc::make_mut(&mut router.groups).insert(event_type, group);
        router
    }

    /// Wraps every route in `layer`, and every [`BatchHandler`]'s group call
    /// too, so a batch keeps handing such a handler its events together
    /// (see [`layer`](Router::layer), which drops the groups). `layer` serves
    /// both a delivery (`InTx<Delivery>`) and a group
    /// (`InTx<Vec<Delivery>>`): tower's `TimeoutLayer`,
    /// `ConcurrencyLimitLayer` and other request-agnostic layers do.
    ///
    /// ```
    /// use inbox_consumer::prelude::*;
    /// # use serde::{Deserialize, Serialize};
    /// # #[derive(Serialize, Deserialize, JsonSchema)]
    /// # struct InvoicePaid { invoice_id: String }
    /// # impl Event for InvoicePaid { const TYPE: &'static str = "invoice.paid"; }
    /// # #[derive(Clone)]
    /// # struct MarkPaid;
    /// # impl BatchHandler for MarkPaid {
    /// #     type Message = InvoicePaid;
    /// #     async fn handle_batch(&self, _: Vec<Envelope<InvoicePaid>>, _: &mut sqlx::PgTransaction<'static>) -> Result<(), HandlerError> { Ok(()) }
    /// # }
    /// let router = Router::new()
    ///     .batch_handler(MarkPaid)
    ///     .batch_layer(tower::limit::ConcurrencyLimitLayer::new(4));
    /// assert_eq!(router.event_types(), ["invoice.paid"]);
    /// ```
    #[must_use]
    pub fn batch_layer<L>(self, layer: L) -> Self
    where
        L: Layer<TxRoute> + Layer<GroupRoute>,
        <L as Layer<TxRoute>>::Service:
            Service<InTx<Delivery>, Response = InTx<Outcome>> + Clone + Send + Sync + 'static,
        <<L as Layer<TxRoute>>::Service as Service<InTx<Delivery>>>::Error: Into<BoxError>,
        <<L as Layer<TxRoute>>::Service as Service<InTx<Delivery>>>::Future: Send + 'static,
        <L as Layer<GroupRoute>>::Service:
            Service<InTx<Vec<Delivery>>, Response = InTx<()>> + Clone + Send + Sync + 'static,
        <<L as Layer<GroupRoute>>::Service as Service<InTx<Vec<Delivery>>>>::Error: Into<BoxError>,
        <<L as Layer<GroupRoute>>::Service as Service<InTx<Vec<Delivery>>>>::Future: Send + 'static,
    {
        let routes = self
            .routes
            .iter()
            .map(|(event_type, route)| {
                let route = Layer::<TxRoute>::layer(&layer, route.clone());
                (event_type.clone(), boxed(route))
            })
            .collect();
        let groups = self
            .groups
            .iter()
            .map(|(event_type, group)| {
                let group = Layer::<GroupRoute>::layer(&layer, group.clone());
                (event_type.clone(), boxed(group))
            })
            .collect();
        Self {
            routes: Arc::new(routes),
            groups: Arc::new(groups),
        }
    }
}

/// The group routes of the types routed to a [`BatchHandler`]; see
/// [`batch_handler`](Router::batch_handler), and [`layer`](Router::layer),
/// which drops them.
impl GroupBatching for Router<InTx<Delivery>, InTx<Outcome>> {
    fn group_route(&self, event_type: &str) -> Option<&GroupRoute> {
        self.groups.get(event_type)
    }
}

impl<Req, Resp> Service<Req> for Router<Req, Resp>
where
    Req: Routable + Send + 'static,
    Resp: Send + 'static,
{
    type Response = Resp;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Resp, BoxError>>;

    /// Always ready: each route is driven to readiness in `call` (`oneshot`).
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Req) -> Self::Future {
        match self.routes.get(request.event_type()) {
            Some(route) => Box::pin(route.clone().oneshot(request)),
            None => {
                let error = Error::new(
                    ErrorKind::Unroutable,
                    format!(
                        "no handler is routed for event type `{}`",
                        request.event_type()
                    ),
                );
                Box::pin(std::future::ready(Err(
                    Box::new(HandlerError::reject(error)) as BoxError,
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use outbox_pg::Envelope;
    use tower::service_fn;

    use super::*;
    use crate::delivery::DeliveryInfo;
    use crate::error::Action;

    fn delivery(event_type: &str) -> Delivery {
        let env = Envelope::new(event_type, "svc", "s1", serde_json::json!({})).unwrap();
        Delivery::new(env, DeliveryInfo::new("c1"))
    }

    #[derive(Clone)]
    struct Group;

    impl BatchHandler for Group {
        type Message = serde_json::Value;
        async fn handle_batch(
            &self,
            _: Vec<Envelope<serde_json::Value>>,
            _: &mut sqlx::PgTransaction<'static>,
        ) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    #[test]
    fn a_batch_handler_has_a_group_route_until_its_type_is_routed_again() {
        let router: Router<InTx<Delivery>, InTx<Outcome>> = Router::new()
            .route_batch_handler("a.one", Group)
            .route_batch_handler("a.two", Group);
        assert_eq!(router.event_types(), ["a.one", "a.two"]);
        let mut groups: Vec<String> = router.groups.keys().cloned().collect();
        groups.sort_unstable();
        assert_eq!(groups, ["a.one", "a.two"]);

        // A plain route for the type replaces the batch handler, group and all.
        let replaced = router.clone().route("a.one", HandlerService::new(Plain));
        assert_eq!(replaced.event_types(), ["a.one", "a.two"]);
        assert!(!replaced.groups.contains_key("a.one"));
        assert!(replaced.groups.contains_key("a.two"));
        // The clone it came from keeps its own.
        assert!(router.groups.contains_key("a.one"));
    }

    #[test]
    fn layer_wraps_the_routes_and_drops_the_groups_batch_layer_keeps_them() {
        let router: Router<InTx<Delivery>, InTx<Outcome>> = Router::new()
            .route_batch_handler("a.one", Group)
            .route("a.two", HandlerService::new(Plain));
        let timeout = tower::timeout::TimeoutLayer::new(std::time::Duration::from_secs(1));

        let each = router.clone().layer(timeout.clone());
        assert_eq!(each.event_types(), ["a.one", "a.two"]);
        assert!(each.groups.is_empty(), "a group would pass the layer by");

        let batched = router.batch_layer(timeout);
        assert_eq!(batched.event_types(), ["a.one", "a.two"]);
        let groups: Vec<String> = batched.groups.keys().cloned().collect();
        assert!(batched.group_route("a.one").is_some() && batched.group_route("a.two").is_none());
        assert_eq!(groups, ["a.one"]);
    }

    #[derive(Clone)]
    struct Plain;

    impl Handler for Plain {
        type Message = serde_json::Value;
        async fn handle(
            &self,
            _: Envelope<serde_json::Value>,
            _: &mut sqlx::PgTransaction<'static>,
        ) -> Result<(), HandlerError> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn routes_by_event_type_and_rejects_the_unrouted() {
        let handled =
            |outcome| service_fn(move |_: Delivery| async move { Ok::<_, BoxError>(outcome) });
        let router = Router::new()
            .route("a.one", handled(Outcome::Handled))
            .route("a.two", handled(Outcome::Stale));
        assert_eq!(router.event_types(), ["a.one", "a.two"]);

        let out = router.clone().oneshot(delivery("a.one")).await.unwrap();
        assert_eq!(out, Outcome::Handled);
        let out = router.clone().oneshot(delivery("a.two")).await.unwrap();
        assert_eq!(out, Outcome::Stale);

        let err = router.oneshot(delivery("a.three")).await.unwrap_err();
        let err = err.downcast_ref::<HandlerError>().unwrap();
        assert_eq!(err.action(), Action::Reject);
        assert!(err.to_string().contains("a.three"), "{err}");
    }
}
