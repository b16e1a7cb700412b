//! Transactional dedupe: the inbox row and the handler's effects commit together.
//!
//! [`Dedupe`] is where the transaction lives. Per delivery it
//!
//! 1. begins a transaction,
//! 2. inserts `(consumer, event id, type, subject, event time, sequence)` into
//!    `inbox_events` with `ON CONFLICT DO NOTHING` (a failing insert would abort
//!    the transaction; a skipped one leaves it usable),
//! 3. on a conflict rolls back and returns [`Outcome::Duplicate`] without calling
//!    the inner service — the runtime acks it, counts
//!    `inbox_duplicates_total{consumer,event_type}` and logs at `info`;
//! 4. otherwise calls the inner `Service<InTx<Delivery>>` (normally a
//!    [`HandlerService`](crate::HandlerService), maybe behind a
//!    [`Router`](crate::Router) or [`SkipStale`](crate::ordering::SkipStale)),
//!    which hands the transaction back,
//! 5. checks that the transaction is not aborted (a handler that swallowed a
//!    failed statement and returned `Ok` would otherwise "commit" a rollback
//!    and the event would be acked without its effect) — for a delivery that
//!    carries a [`leader_epoch`](Delivery::leader_epoch) (an ordered
//!    consumer), the leader fence's check does it, as its first statement
//!    fails on an aborted transaction, and a deposed leader rolls back with
//!    [`ErrorKind::LeaseLost`](crate::ErrorKind::LeaseLost) —, commits, and only then
//!    resolves. The runtime acks after this future
//!    resolves `Ok`, so an ack always follows a commit; a failed commit is an
//!    error, and an error is never acked.
//!
//! The primary key `(consumer, event_id)` is the whole mechanism: there is no
//! in-memory seen-set, so it holds across restarts and replicas. Two replicas
//! handling the same event at once serialise on the key: the second insert
//! waits for the first transaction and then sees the conflict.
//!
//! The consumer name (the dedupe namespace) is [`Delivery::consumer`], which the
//! runtime fills with the durable consumer's name.
//!
//! Every transaction begins with the [`Timeouts`] (lock, statement, idle in
//! transaction) set in the same statement, so no wait in it is unbounded.
//!
//! As a `Service<Vec<Delivery>>`, for [`Consumer::run_batched`](crate::Consumer::run_batched),
//! `Dedupe` handles a whole batch in one transaction: see [`batch`].

pub mod batch;
mod layer;
mod timeouts;

use std::fmt;
use std::mem;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use sqlx::{PgConnection, PgPool, PgTransaction};
use tower::Service;

use crate::delivery::{Delivery, InTx, Outcome};
use crate::error::{BoxError, Error, ErrorKind};
use crate::fence::{FenceKey, check_fence};
use crate::metrics::names;

pub use layer::DedupeLayer;
pub use timeouts::Timeouts;

/// Records the delivery's event in the inbox inside `conn`'s transaction,
/// with its `sequence` (NULL when it carries none) for
/// [`SkipStale`](crate::ordering::SkipStale).
/// Returns `false` when the consumer already has it (a duplicate).
///
/// # Errors
/// [`ErrorKind::InvalidEnvelope`](crate::ErrorKind::InvalidEnvelope), before
/// anything is written, if the event's sequence is above `i64::MAX`: the
/// inbox stores it as a `bigint`, and clamping would rank the event above
/// every later one of its subject (see the
/// [ordering docs](crate::ordering#sequences-are-per-outbox-database)).
/// [`ErrorKind::Database`](crate::ErrorKind::Database) if the insert fails.
pub async fn record(conn: &mut PgConnection, delivery: &Delivery) -> Result<bool, Error> {
    let env = delivery.envelope();
    let sequence = crate::ordering::sequence_column(env.sequence())?;
    let done = sqlx::query_file!(
        "queries/insert_inbox.sql",
        delivery.consumer(),
        uuid::Uuid::from(env.id()),
        env.event_type().as_str(),
        env.subject(),
        env.time(),
        sequence,
    )
    .execute(conn)
    .await
    .map_err(|e| Error::database("inserting into inbox_events", e))?;
    Ok(done.rows_affected() == 1)
}

/// Dedupes deliveries through the inbox, in the transaction of the inner service.
/// See the [module docs](self).
#[derive(Clone)]
pub struct Dedupe<S> {
    inner: S,
    pool: PgPool,
    timeouts: Timeouts,
}

impl<S> Dedupe<S> {
    /// Wraps `inner`; transactions come from `pool`, bounded by the default
    /// [`Timeouts`].
    pub fn new(inner: S, pool: PgPool) -> Self {
        Self {
            inner,
            pool,
            timeouts: Timeouts::default(),
        }
    }

    /// Bounds the waits of every transaction: lock, statement and idle
    /// timeouts. Default: [`Timeouts::default`].
    #[must_use]
    pub fn timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
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

impl<S: fmt::Debug> fmt::Debug for Dedupe<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dedupe")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> Service<Delivery> for Dedupe<S>
where
    S: Service<InTx<Delivery>, Response = InTx<Outcome>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Outcome, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, delivery: Delivery) -> Self::Future {
        // The ready service goes into the future; the clone stays for next time.
        let clone = self.inner.clone();
        let mut inner = mem::replace(&mut self.inner, clone);
        let (pool, begin) = (self.pool.clone(), self.timeouts.begin_statement());
        Box::pin(async move {
            let mut tx = begin_tx(&pool, begin).await?;
            if !record(&mut tx, &delivery).await? {
                if let Err(e) = tx.rollback().await {
                    tracing::debug!(error = %e, "rollback after a duplicate failed");
                }
                note_duplicate(&delivery);
                return Ok(Outcome::Duplicate);
            }
            let (consumer, fence) = (delivery.consumer().to_owned(), delivery.fence());
            let (tx, outcome) = inner
                .call(InTx::new(tx, delivery))
                .await
                .map_err(Into::into)?
                .into_parts();
            commit(tx, &consumer, fence).await?;
            Ok(outcome)
        })
    }
}

/// Most connections a transaction's `BEGIN` is tried on.
const BEGIN_TRIES: usize = 3;

/// Begins a transaction with `begin` (the statement that also sets its
/// timeouts). A pooled connection the server dropped since it was last used
/// fails its `BEGIN`, which had no effect: the transaction is begun again on
/// another connection (a pool built with [`handler_pool`](crate::pool::handler_pool)
/// does not test a recently used connection before handing it out).
async fn begin_tx(pool: &PgPool, begin: String) -> Result<PgTransaction<'static>, Error> {
    let mut tries = 1;
    loop {
        // Not checked at compile time: built at run time from `Timeouts` (`SET LOCAL`).
        match pool.begin_with(sqlx::AssertSqlSafe(begin.clone())).await {
            Ok(tx) => return Ok(tx),
            Err(e) if tries < BEGIN_TRIES && connection_dropped(&e) => {
                tracing::debug!(error = %e, "a pooled connection was dropped; beginning on another");
                tries += 1;
            }
            Err(e) => return Err(Error::database("beginning the inbox transaction", e)),
        }
    }
}

/// Whether `error` says the connection itself is gone (closed, reset, or
/// ended by the server: SQLSTATE class 08 and 57P01–57P03), rather than that
/// the statement failed.
fn connection_dropped(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(e) => e
            .code()
            .is_some_and(|code| code.starts_with("08") || code.starts_with("57P0")),
        _ => false,
    }
}

/// What a handler that returned `Ok` on an aborted transaction is told.
const ABORTED: &str = "the handler returned Ok but its transaction is aborted (a statement failed)";

/// Commits a handler's transaction, after checking that no statement in it
/// failed and, for an ordered consumer's leader, that it still leads.
async fn commit(
    mut tx: PgTransaction<'static>,
    consumer: &str,
    fence: Option<(i64, Option<FenceKey>)>,
) -> Result<(), Error> {
    // A handler that swallowed a failed statement returns Ok on an aborted
    // transaction, whose COMMIT silently rolls back: acking it would lose the
    // event. Refuse to commit it instead. A leader's fence check is the first
    // statement after the handler's and fails there (SQLSTATE 25P02) exactly
    // as the check would, so it stands for it: one round trip fewer.
    match fence {
        Some((epoch, key)) => check_fence(&mut tx, consumer, epoch, key)
            .await
            .map_err(|e| {
                if in_failed_transaction(&e) {
                    Error::new(ErrorKind::Database, format!("{ABORTED}: {e}")).with_source(e)
                } else {
                    e
                }
            })?,
        None => {
            sqlx::query_file!("queries/check_tx.sql")
                .fetch_one(&mut *tx)
                .await
                .map_err(|e| Error::database(ABORTED, e))?;
        }
    }
    tx.commit()
        .await
        .map_err(|e| Error::database("committing the handler's transaction", e))
}

/// Whether `error` is a statement refused because the transaction is
/// aborted (SQLSTATE `25P02`).
fn in_failed_transaction(error: &Error) -> bool {
    outbox_pg::sqlstate(error).as_deref() == Some("25P02")
}

/// Counts and logs a delivery the inbox already held.
fn note_duplicate(delivery: &Delivery) {
    metrics::counter!(
        names::DUPLICATES,
        "consumer" => delivery.consumer().to_owned(),
        "event_type" => delivery.event_type().as_str().to_owned(),
    )
    .increment(1);
    tracing::info!(
        consumer = delivery.consumer(),
        event_id = %delivery.id(),
        event_type = %delivery.event_type(),
        subject = delivery.subject(),
        delivered = delivery.info().delivered,
        "duplicate delivery skipped: the inbox already holds this event",
    );
}
