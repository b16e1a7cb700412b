use std::fmt;

use sqlx::PgPool;
use tower::Layer;

use super::Dedupe;

/// Applies [`Dedupe`] to a `Service<InTx<Delivery>>`.
#[derive(Clone)]
pub struct DedupeLayer {
    pool: PgPool,
}

impl DedupeLayer {
    /// Dedupes through the inbox, with transactions from `pool`.
    pub const fn new(pool: PgPool) -> Self {
        Self { pool }
    }
}

impl fmt::Debug for DedupeLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DedupeLayer").finish_non_exhaustive()
    }
}

impl<S> Layer<S> for DedupeLayer {
    type Service = Dedupe<S>;

    fn layer(&self, inner: S) -> Dedupe<S> {
        Dedupe::new(inner, self.pool.clone())
    }
}
