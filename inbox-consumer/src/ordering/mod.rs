//! Order-dependent handlers: skip an event older than one already applied.
//!
//! Events of one subject arrive in publish order from one relay, but a
//! redelivery can arrive late (the contract's rule 3: "order by subject, not by
//! arrival"). The inbox already records, per consumer, every applied event's
//! subject and time, so "the latest applied event time for this subject" is one
//! indexed query ([`last_applied`]).
//!
//! [`SkipStale`] sits inside [`Dedupe`](crate::dedupe::Dedupe) (it needs the
//! transaction) in front of a handler whose effect must not go backwards (a
//! "current plan" column, say). If the subject already has an applied event with
//! a **later** time, the handler is skipped and the outcome is
//! [`Outcome::Stale`]; the inbox row still commits, so a redelivery of the stale
//! event is a plain duplicate. Equal times are applied.
//!
//! The check reads committed rows, so it orders events handled one after the
//! other, which the runtime guarantees per subject within one process. Handlers
//! that need more (a merge rather than a skip) can call [`last_applied`]
//! themselves from [`Handler::handle`](crate::Handler::handle).

pub mod future;
mod layer;

use std::mem;
use std::task::{Context, Poll};

use chrono::{DateTime, Utc};
use outbox_core::EventId;
use sqlx::PgConnection;
use tower::Service;

use crate::delivery::{Delivery, InTx, Outcome};
use crate::error::{BoxError, Error};

pub use layer::SkipStaleLayer;

const LAST_APPLIED: &str = include_str!("../../queries/last_applied.sql");

/// The latest event time `consumer` has recorded for `subject`, other than
/// `except` (the event being handled, whose inbox row is already inserted).
///
/// # Errors
/// [`ErrorKind::Database`](crate::ErrorKind::Database) if the query fails.
pub async fn last_applied(
    conn: &mut PgConnection,
    consumer: &str,
    subject: &str,
    except: EventId,
) -> Result<Option<DateTime<Utc>>, Error> {
    sqlx::query_scalar::<_, Option<DateTime<Utc>>>(LAST_APPLIED)
        .bind(consumer)
        .bind(subject)
        .bind(except.as_uuid())
        .fetch_one(conn)
        .await
        .map_err(|e| Error::database("reading the last applied event time", e))
}

/// Skips events older than one already applied for their subject. See the
/// [module docs](self).
#[derive(Debug, Clone)]
pub struct SkipStale<S> {
    inner: S,
}

impl<S> SkipStale<S> {
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

impl<S> Service<InTx<Delivery>> for SkipStale<S>
where
    S: Service<InTx<Delivery>, Response = InTx<Outcome>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = InTx<Outcome>;
    type Error = BoxError;
    type Future = future::ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut request: InTx<Delivery>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = mem::replace(&mut self.inner, clone);
        future::ResponseFuture::new(async move {
            let (tx, delivery) = request.parts_mut();
            let last =
                last_applied(tx, delivery.consumer(), delivery.subject(), delivery.id()).await?;
            if let Some(last) = last.filter(|last| *last > delivery.envelope().time()) {
                tracing::info!(
                    consumer = delivery.consumer(),
                    event_id = %delivery.id(),
                    subject = delivery.subject(),
                    event_time = %delivery.envelope().time(),
                    last_applied = %last,
                    "stale event skipped: a later event of this subject was already applied",
                );
                return Ok(request.map(|_| Outcome::Stale));
            }
            inner.call(request).await.map_err(Into::into)
        })
    }
}
