//! The `_up` gauges: what the relay last saw of its database and its broker,
//! exported as `outbox_relay_database_up` and `outbox_relay_broker_up` (1/0)
//! after every batch and every `stats_interval`.
//!
//! The states themselves are kept by the workers (`note_db_health`,
//! `note_broker_health`), which log each change once. The broker counts as
//! up while NATS is connected and the last publishes were acked; a batch that
//! finds nothing to publish while connected brings it back up, so an idle
//! relay does not stay "down" after an outage it had nothing to publish in.

use std::sync::atomic::Ordering;

use tracing::info;

use super::{BatchReport, Relay};
use crate::error::Result;
use crate::metrics;
use crate::sink::Sink;

impl<S: Sink> Relay<S> {
    /// After a batch: an empty one while connected means the broker is fine.
    pub(super) fn note_broker_idle(&self, result: &Result<BatchReport>) {
        if matches!(result, Ok(report) if report.claimed == 0)
            && self.sink.is_available()
            && !self.broker_up.swap(true, Ordering::Relaxed)
        {
            info!("broker connected again; nothing was waiting to publish");
        }
    }

    /// Sets the `_up` gauges from the last known states.
    pub(super) fn report_health(&self) {
        metrics::database_up(self.db_up.load(Ordering::Relaxed));
        metrics::broker_up(self.broker_up.load(Ordering::Relaxed) && self.sink.is_available());
    }
}
