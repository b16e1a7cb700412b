//! [`HandlerService`]: a [`Handler`] as a tower service inside the transaction;
//! [`BatchHandlerService`] the same for a [`BatchHandler`], one group at a time.

use std::fmt;
use std::future::Future;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use outbox_pg::Envelope;
use serde_json::Value;
use sqlx::PgTransaction;
use tower::Service;
use tracing::Instrument;

use crate::batch_handler::BatchHandler;
use crate::delivery::{Delivery, InTx, Outcome};
use crate::error::{Error, ErrorKind, HandlerError};
use crate::grouping::{GroupBatching, GroupRoute};
use crate::handler::Handler;

/// Runs a [`Handler`] on an [`InTx<Delivery>`]: decodes `data` into
/// `H::Message`, lends the transaction to [`Handler::handle`], and hands the
/// transaction back for the caller (normally [`Dedupe`](crate::dedupe::Dedupe))
/// to commit.
///
/// On failure the transaction is rolled back here, before the error is
/// returned. A payload that does not decode is a reject with an
/// [`ErrorKind::Decode`] source: the runtime dead-letters it as
/// `undecodable_payload`.
#[derive(Clone)]
pub struct HandlerService<H> {
    handler: H,
}

impl<H> HandlerService<H> {
    /// Wraps `handler`.
    pub const fn new(handler: H) -> Self {
        Self { handler }
    }

    /// The handler.
    pub fn get_ref(&self) -> &H {
        &self.handler
    }

    /// The handler, mutably.
    pub fn get_mut(&mut self) -> &mut H {
        &mut self.handler
    }

    /// Unwraps the handler.
    pub fn into_inner(self) -> H {
        self.handler
    }
}

impl<H> fmt::Debug for HandlerService<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerService")
            .field("handler", &std::any::type_name::<H>())
            .finish()
    }
}

/// The future of [`HandlerService`] and [`BatchHandlerService`].
type ResponseFuture = BoxFuture<'static, Result<InTx<Outcome>, HandlerError>>;

/// `handled`, run in `span` when there is one (a delivery's own span in batch
/// mode, see `crate::trace`), else in the caller's.
fn in_span<F>(span: Option<tracing::Span>, handled: F) -> ResponseFuture
where
    F: Future<Output = Result<InTx<Outcome>, HandlerError>> + Send + 'static,
{
    match span {
        Some(span) => Box::pin(handled.instrument(span)),
        None => Box::pin(handled),
    }
}

/// Keeps no groups: a handler takes one event at a time.
impl<H> GroupBatching for HandlerService<H> {
    fn group_route(&self, _event_type: &str) -> Option<&GroupRoute> {
        None
    }
}

impl<H: Handler> Service<InTx<Delivery>> for HandlerService<H> {
    type Response = InTx<Outcome>;
    type Error = HandlerError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: InTx<Delivery>) -> Self::Future {
        let handler = self.handler.clone();
        // In batch mode, the delivery's own span (see `crate::trace`).
        let span = request.get_ref().span().cloned();
        let handled = async move {
            let (mut tx, delivery) = request.into_parts();
            let result = match typed_from::<H::Message>(delivery.envelope()) {
                Ok(event) => handler.handle(event, &mut tx).await,
                Err(e) => Err(HandlerError::reject(e)),
            };
            hand_back(tx, result, Outcome::Handled).await
        };
        in_span(span, handled)
    }
}

/// Runs a [`BatchHandler`]: a `Service<InTx<Delivery>>` handing the handler a
/// group of one, and a `Service<InTx<Vec<Delivery>>>` handing it a whole group
/// (what [`Router::batch_handler`](crate::Router::batch_handler) routes a
/// batch's events of the type to). Decoding, rollback on failure and the
/// delivery's span as for [`HandlerService`]; a group runs in the caller's span.
#[derive(Clone)]
pub struct BatchHandlerService<H> {
    handler: H,
}

impl<H> BatchHandlerService<H> {
    /// Wraps `handler`.
    pub const fn new(handler: H) -> Self {
        Self { handler }
    }

    /// The handler.
    pub fn get_ref(&self) -> &H {
        &self.handler
    }
}

impl<H> fmt::Debug for BatchHandlerService<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchHandlerService")
            .field("handler", &std::any::type_name::<H>())
            .finish()
    }
}

/// Keeps no groups: alone under a [`Dedupe`](crate::Dedupe), the handler
/// gets each event of a batch as a group of one. Routed through a
/// [`Router`](crate::Router) ([`Router::batch_handler`](crate::Router::batch_handler)),
/// it gets the batch's events of its type together.
impl<H> GroupBatching for BatchHandlerService<H> {
    fn group_route(&self, _event_type: &str) -> Option<&GroupRoute> {
        None
    }
}

impl<H: BatchHandler> Service<InTx<Delivery>> for BatchHandlerService<H> {
    type Response = InTx<Outcome>;
    type Error = HandlerError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: InTx<Delivery>) -> Self::Future {
        let span = request.get_ref().span().cloned();
        let group = self.call(request.map(|delivery| vec![delivery]));
        let handled = async move { Ok(group.await?.map(|()| Outcome::Handled)) };
        in_span(span, handled)
    }
}

impl<H: BatchHandler> Service<InTx<Vec<Delivery>>> for BatchHandlerService<H> {
    type Response = InTx<()>;
    type Error = HandlerError;
    type Future = BoxFuture<'static, Result<InTx<()>, HandlerError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: InTx<Vec<Delivery>>) -> Self::Future {
        let handler = self.handler.clone();
        Box::pin(async move {
            let (mut tx, deliveries) = request.into_parts();
            let events: Result<Vec<Envelope<H::Message>>, Error> = deliveries
                .iter()
                .map(|delivery| typed_from::<H::Message>(delivery.envelope()))
                .collect();
            let result = match events {
                Ok(events) => handler.handle_batch(events, &mut tx).await,
                Err(e) => Err(HandlerError::reject(e)),
            };
            hand_back(tx, result, ()).await
        })
    }
}

/// The transaction back, with `value`, when the handler succeeded; rolled
/// back here when it failed: the inbox row's lock is released now rather than
/// when the connection is next used (a failed rollback is moot: the
/// connection is discarded and the server rolls back).
async fn hand_back<T>(
    tx: PgTransaction<'static>,
    result: Result<(), HandlerError>,
    value: T,
) -> Result<InTx<T>, HandlerError> {
    match result {
        Ok(()) => Ok(InTx::new(tx, value)),
        Err(e) => {
            if let Err(rollback) = tx.rollback().await {
                tracing::debug!(error = %rollback, "rollback after a handler error failed");
            }
            Err(e)
        }
    }
}

/// Decodes the payload of `envelope` as `T`, keeping every attribute.
///
/// # Errors
/// [`ErrorKind::Decode`] naming the event, its type and the target type.
pub fn typed<T: serde::de::DeserializeOwned>(
    envelope: Envelope<Value>,
) -> Result<Envelope<T>, Error> {
    // Owned: the payload's strings move into `T` rather than being copied.
    let mut data = Value::Null;
    let envelope = envelope.map_data(|v| data = v);
    match serde_json::from_value::<T>(data) {
        Ok(t) => Ok(envelope.map_data(|()| t)),
        Err(e) => Err(undecodable::<T, _>(&envelope, e)),
    }
}

/// [`typed`] of a borrowed envelope: decodes the payload without copying the
/// whole of it first (a delivery's envelope is shared between its attempts).
pub(crate) fn typed_from<T: serde::de::DeserializeOwned>(
    envelope: &Envelope<Value>,
) -> Result<Envelope<T>, Error> {
    match T::deserialize(envelope.data()) {
        Ok(t) => Ok(envelope.with_data(t)),
        Err(e) => Err(undecodable::<T, _>(envelope, e)),
    }
}

/// [`ErrorKind::Decode`] naming the event, its type and the target type.
fn undecodable<T, D>(envelope: &Envelope<D>, e: serde_json::Error) -> Error {
    Error::new(
        ErrorKind::Decode,
        format!(
            "data of event `{}` (type `{}`) does not decode as {}: {e}",
            envelope.id(),
            envelope.event_type(),
            std::any::type_name::<T>()
        ),
    )
    .with_source(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Plan {
        plan: String,
    }

    #[test]
    fn typed_decodes_or_names_the_failure() {
        let env = Envelope::new("a.b", "svc", "s1", serde_json::json!({"plan": "pro"})).unwrap();
        let t = typed::<Plan>(env.clone()).unwrap();
        assert_eq!(t.data().plan, "pro");
        assert_eq!(t.id(), env.id());
        let bad = Envelope::new("a.b", "svc", "s1", serde_json::json!({"plan": 1})).unwrap();
        let err = typed::<Plan>(bad).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Decode);
        assert!(err.to_string().contains("a.b"), "{err}");
    }
}
