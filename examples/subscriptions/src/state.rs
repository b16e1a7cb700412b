//! [`AppState`]: what every handler shares.

use axum::http::HeaderMap;
use outbox_pg::Outbox;
use sqlx::PgPool;

/// Request header that asks for an injected rollback (with `--fault-injection`).
pub const FAULT_HEADER: &str = "x-fault";

/// The pool, the outbox (with its schema registry) and the fault switch.
#[derive(Debug, Clone)]
pub struct AppState {
    pub(crate) pool: PgPool,
    pub(crate) outbox: Outbox,
    pub(crate) fault_injection: bool,
}

impl AppState {
    /// State over `pool`, writing events through `outbox`. Fault injection is off.
    pub fn new(pool: PgPool, outbox: Outbox) -> Self {
        Self {
            pool,
            outbox,
            fault_injection: false,
        }
    }

    /// Honours `x-fault: rollback` on write requests: the writes are done,
    /// then rolled back, and the request answers `500`. Default: off, and the
    /// header is ignored. For tests and demos only.
    #[must_use]
    pub fn fault_injection(mut self, on: bool) -> Self {
        self.fault_injection = on;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether this request asks for an injected rollback and may have one.
    pub(crate) fn rollback_requested(&self, headers: &HeaderMap) -> bool {
        self.fault_injection
            && headers
                .get(FAULT_HEADER)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("rollback"))
    }
}
