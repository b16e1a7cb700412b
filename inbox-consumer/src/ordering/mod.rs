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
//! The read and the record share one lock: before reading, [`SkipStale`]
//! takes the subject's lock ([`lock_subject`]), held until the transaction
//! ends. Two replicas handling events of one subject at the same moment
//! therefore run one after the other: the second reads after the first has
//! committed its inbox row, so it sees the first's time and skips itself if it
//! is older. Without the lock both would read "nothing newer", both apply, and
//! the older could commit last.
//!
//! Handlers that need more (a merge rather than a skip) call [`lock_subject`]
//! and then [`last_applied`] themselves from
//! [`Handler::handle`](crate::Handler::handle), in that order.
//!
//! To keep replicas from handling a subject's events concurrently at all, and
//! in stream order, see [`ConsumerConfig::ordered`](crate::ConsumerConfig::ordered).

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
const LOCK_SUBJECT: &str = include_str!("../../queries/lock_subject.sql");

/// Takes `consumer`'s lock on `subject`, held until `conn`'s transaction
/// commits or rolls back; waits while another transaction holds it.
///
/// Every transaction of `consumer` that reads state of `subject` to decide
/// what to write (an "apply only if newer" check, a merge) should take it
/// before that read, so that the read and the write are not split by another
/// replica's commit. Outside a transaction the lock is released at once.
///
/// # Errors
/// [`ErrorKind::Database`](crate::ErrorKind::Database) if the statement fails.
pub async fn lock_subject(
    conn: &mut PgConnection,
    consumer: &str,
    subject: &str,
) -> Result<(), Error> {
    sqlx::query(LOCK_SUBJECT)
        .bind(consumer)
        .bind(subject)
        .execute(conn)
        .await
        .map_err(|e| Error::database("taking the subject's lock", e))?;
    Ok(())
}

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
            lock_subject(tx, delivery.consumer(), delivery.subject()).await?;
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
