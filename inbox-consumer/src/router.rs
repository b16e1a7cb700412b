//! [`Router`]: one process, several event types, one handler stack each.
//!
//! A router dispatches on the envelope's event type. It works at either level
//! of the stack:
//!
//! - inside [`Dedupe`](crate::dedupe::Dedupe), as a `Service<InTx<Delivery>>`
//!   routing to [`HandlerService`](crate::HandlerService)s: one transaction
//!   and one inbox row per delivery, whatever the type;
//! - outside it, as a `Service<Delivery>` routing to whole stacks, when types
//!   need different layers.
//!
//! An event type with no route fails with [`ErrorKind::Unroutable`], a reject:
//! the runtime dead-letters it as `unroutable` rather than dropping it. Use the
//! consumer's filter subjects to receive only the routed types.
//!
//! Each consumer name is its own dedupe namespace: two consumers (two durables,
//! or two runtimes with different names) each handle every event once.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt};

use crate::delivery::{Delivery, InTx};
use crate::error::{BoxError, Error, ErrorKind, HandlerError};

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

type Route<Req, Resp> = BoxCloneSyncService<Req, Resp, BoxError>;

/// Routes requests by event type. Cheap to clone. See the [module docs](self).
pub struct Router<Req, Resp> {
    routes: Arc<HashMap<String, Route<Req, Resp>>>,
}

impl<Req, Resp> Clone for Router<Req, Resp> {
    fn clone(&self) -> Self {
        Self {
            routes: Arc::clone(&self.routes),
        }
    }
}

impl<Req, Resp> Default for Router<Req, Resp> {
    fn default() -> Self {
        Self {
            routes: Arc::new(HashMap::new()),
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
        let service = BoxCloneSyncService::new(service.map_err(Into::into));
        // Copy-on-write: a clone of the router keeps its own routes.
        Arc::make_mut(&mut self.routes).insert(event_type.into(), service);
        self
    }

    /// The routed event types, sorted: the filter subjects a consumer needs.
    pub fn event_types(&self) -> Vec<String> {
        let mut types: Vec<String> = self.routes.keys().cloned().collect();
        types.sort_unstable();
        types
    }
}

/// The future of [`Router`].
pub struct ResponseFuture<Resp> {
    inner: Pin<Box<dyn Future<Output = Result<Resp, BoxError>> + Send>>,
}

impl<Resp> fmt::Debug for ResponseFuture<Resp> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<Resp> Future for ResponseFuture<Resp> {
    type Output = Result<Resp, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<Req, Resp> Service<Req> for Router<Req, Resp>
where
    Req: Routable + Send + 'static,
    Resp: Send + 'static,
{
    type Response = Resp;
    type Error = BoxError;
    type Future = ResponseFuture<Resp>;

    /// Always ready: each route is driven to readiness in `call` (`oneshot`).
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let inner: Pin<Box<dyn Future<Output = Result<Resp, BoxError>> + Send>> =
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
            };
        ResponseFuture { inner }
    }
}
