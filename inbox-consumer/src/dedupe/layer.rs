use std::fmt;

use sqlx::PgPool;
use tower::Layer;

use super::{Dedupe, Timeouts};

/// Applies [`Dedupe`] to a `Service<InTx<Delivery>>`.
#[derive(Clone)]
pub struct DedupeLayer {
    pool: PgPool,
    timeouts: Timeouts,
}

impl DedupeLayer {
    /// Dedupes through the inbox, with transactions from `pool`, bounded by
    /// the default [`Timeouts`].
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            timeouts: Timeouts::default(),
        }
    }

    /// Bounds the waits of every transaction. Default: [`Timeouts::default`].
    #[must_use]
    pub fn timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }
}

impl fmt::Debug for DedupeLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DedupeLayer")
            .field("timeouts", &self.timeouts)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for DedupeLayer {
    type Service = Dedupe<S>;

    fn layer(&self, inner: S) -> Dedupe<S> {
        Dedupe::new(inner, self.pool.clone()).timeouts(self.timeouts)
    }
}
