//! Counters and a latency histogram per delivery, through the `metrics` crate.
//!
//! [`Metrics`] wraps a `Service<Delivery, Response = Outcome>` and records,
//! labelled `consumer` and `event_type`:
//!
//! | name | kind | when |
//! | --- | --- | --- |
//! | `inbox_handled_total` | counter | the handler's effects committed |
//! | `inbox_stale_total` | counter | skipped as older than an applied event |
//! | `inbox_failed_total` | counter | the stack returned an error (rolled back) |
//! | `inbox_handler_duration_seconds` | histogram | every handled or failed delivery |
//!
//! Elsewhere: `inbox_duplicates_total` is counted by
//! [`Dedupe`](crate::dedupe::Dedupe) (so it is counted with or without this
//! layer) and `inbox_dead_lettered_total` (with a `reason` label) by the runtime.
//! Install any `metrics` recorder (for example `metrics-exporter-prometheus`)
//! to export them.

pub mod future;
mod layer;

use std::task::{Context, Poll};
use std::time::Instant;

use tower::Service;

use crate::delivery::{Delivery, Outcome};

pub use layer::MetricsLayer;

/// Metric names.
pub mod names {
    /// Counter: deliveries whose effects committed.
    pub const HANDLED: &str = "inbox_handled_total";
    /// Counter: deliveries skipped as stale.
    pub const STALE: &str = "inbox_stale_total";
    /// Counter: deliveries that failed and rolled back.
    pub const FAILED: &str = "inbox_failed_total";
    /// Counter: deliveries the inbox already held.
    pub const DUPLICATES: &str = "inbox_duplicates_total";
    /// Counter: messages dead-lettered (extra label `reason`).
    pub const DEAD_LETTERED: &str = "inbox_dead_lettered_total";
    /// Histogram: seconds from the start of a delivery's handling to its commit or failure.
    pub const HANDLER_DURATION: &str = "inbox_handler_duration_seconds";
}

/// Records counts and latency of the inner service. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Metrics<S> {
    inner: S,
}

impl<S> Metrics<S> {
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

impl<S> Service<Delivery> for Metrics<S>
where
    S: Service<Delivery, Response = Outcome>,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = future::ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, delivery: Delivery) -> Self::Future {
        let labels = [
            ("consumer", delivery.consumer().to_owned()),
            ("event_type", delivery.event_type().as_str().to_owned()),
        ];
        future::ResponseFuture::new(self.inner.call(delivery), Instant::now(), labels)
    }
}
