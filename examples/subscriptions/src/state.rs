//! [`AppState`]: what every handler shares.

use std::time::Duration;

use axum::http::HeaderMap;
use outbox_pg::Outbox;
use sqlx::PgPool;

/// Request header that asks for an injected rollback (with `--fault-injection`).
pub const FAULT_HEADER: &str = "x-fault";

/// How long a trial lasts unless configured ([`AppState::trial_period`]): 14 days.
pub const DEFAULT_TRIAL_PERIOD: Duration = Duration::from_secs(14 * 24 * 3600);

/// The pool, the outbox (with its schema registry), the trial's length and
/// the fault switch.
#[derive(Debug, Clone)]
pub struct AppState {
    pub(crate) pool: PgPool,
    pub(crate) outbox: Outbox,
    pub(crate) trial_period: Duration,
    pub(crate) fault_injection: bool,
}

impl AppState {
    /// State over `pool`, writing events through `outbox`. Trials last
    /// [`DEFAULT_TRIAL_PERIOD`]; fault injection is off.
    pub fn new(pool: PgPool, outbox: Outbox) -> Self {
        Self {
            pool,
            outbox,
            trial_period: DEFAULT_TRIAL_PERIOD,
            fault_injection: false,
        }
    }

    /// How long the trial of a subscription created with `"trial": true`
    /// lasts: its `subscription.trial_ended` falls due this long after the
    /// creating transaction's start. Default: [`DEFAULT_TRIAL_PERIOD`]. A
    /// zero period is raised to a millisecond (a due time not after the
    /// transaction's start would make an immediate event).
    #[must_use]
    pub fn trial_period(mut self, period: Duration) -> Self {
        self.trial_period = period.max(Duration::from_millis(1));
        self
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
