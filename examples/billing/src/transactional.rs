//! [`Transactional`]: the transaction of [`Dedupe`](inbox_consumer::Dedupe)
//! without the inbox row. **For tests only.**
//!
//! It begins a transaction, hands it to the inner `Service<InTx<Delivery>>`
//! (the handlers) and commits what comes back — everything `Dedupe` does
//! except recording the event id. Every redelivery is therefore handled
//! again. `billing --no-dedupe` builds its stack with it so that a chaos run
//! can show that the invariant checker catches double invoices; no real
//! service should run it.

use std::fmt;
use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::task::{Context, Poll};

use inbox_consumer::{BoxError, Delivery, InTx, Outcome};
use sqlx::PgPool;
use tower::{Layer, Service};

/// Applies [`Transactional`].
#[derive(Clone)]
pub struct TransactionalLayer {
    pool: PgPool,
}

impl TransactionalLayer {
    /// Transactions from `pool`.
    pub const fn new(pool: PgPool) -> Self {
        Self { pool }
    }
}

impl fmt::Debug for TransactionalLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionalLayer").finish_non_exhaustive()
    }
}

impl<S> Layer<S> for TransactionalLayer {
    type Service = Transactional<S>;

    fn layer(&self, inner: S) -> Transactional<S> {
        Transactional {
            inner,
            pool: self.pool.clone(),
        }
    }
}

/// Begin → inner service → commit, with no inbox row: every redelivery is
/// handled again. **For tests only** (`billing --no-dedupe`).
#[derive(Clone)]
pub struct Transactional<S> {
    inner: S,
    pool: PgPool,
}

impl<S: fmt::Debug> fmt::Debug for Transactional<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transactional")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S> Service<Delivery> for Transactional<S>
where
    S: Service<InTx<Delivery>, Response = InTx<Outcome>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Outcome, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, delivery: Delivery) -> Self::Future {
        // The ready service goes into the future; the clone stays for next time.
        let clone = self.inner.clone();
        let mut inner = mem::replace(&mut self.inner, clone);
        let pool = self.pool.clone();
        Box::pin(async move {
            let tx = pool.begin().await?;
            let (tx, outcome) = inner
                .call(InTx::new(tx, delivery))
                .await
                .map_err(Into::into)?
                .into_parts();
            tx.commit().await?;
            Ok(outcome)
        })
    }
}
