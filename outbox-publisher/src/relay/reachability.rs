//! The `_up` gauges: what the relay last saw of its database and its broker,
//! exported as `outbox_relay_database_up` and `outbox_relay_broker_up` (1/0)
//! after every batch and every `stats_interval`.
//!
//! The states themselves are kept by the workers (`note_db_health`,
//! `note_broker_health`), which log each change once. The broker counts as
//! up while NATS is connected and the last publishes were acked; a batch that
//! finds nothing to publish while connected brings it back up, so an idle
//! relay does not stay "down" after an outage it had nothing to publish in.
//! A relay that runs no batches (it holds no shards, which is what a lost
//! database session leads to, or the broker is down) pings its database
//! every `stats_interval` instead, so the database gauge still follows.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::{BatchReport, Relay};
use crate::error::{ErrorKind, Result};
use crate::metrics;
use crate::sink::Sink;

/// Bound on the database ping of an idle relay.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a relay whose broker is down asks whether its client is closed.
const CLOSED_CHECK: Duration = Duration::from_secs(1);

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

    /// Pings the database if no batch does it for us (no shards held, or
    /// the broker down), bounded by [`PROBE_TIMEOUT`], and notes the result.
    pub(super) async fn probe_database(&self) {
        if !self.shards.owned().is_empty() && self.sink.is_available() {
            return;
        }
        let check = outbox_pg::health::database(self.store.pool(), PROBE_TIMEOUT).await;
        let up = check.ok();
        if self.db_up.swap(up, Ordering::Relaxed) != up {
            match check.error() {
                None => info!("outbox database available again"),
                Some(e) => warn!(error = %e, "outbox database unavailable; retrying with backoff"),
            }
        }
    }

    /// Resolves with [`ErrorKind::ClientClosed`] once the sink's client is
    /// found closed for good ([`Sink::is_closed`]), which is asked every
    /// [`CLOSED_CHECK`] while the broker counts as down (publishes failed,
    /// or not connected); never before `shutdown`.
    pub(super) async fn client_watch(&self, shutdown: &CancellationToken) -> Option<crate::Error> {
        loop {
            tokio::select! {
                () = tokio::time::sleep(CLOSED_CHECK) => {}
                () = shutdown.cancelled() => return None,
            }
            let down = !self.broker_up.load(Ordering::Relaxed) || !self.sink.is_available();
            if down && self.sink.is_closed() {
                metrics::client_closed();
                metrics::broker_up(false);
                error!(
                    "the NATS client was closed under the relay: nothing can be published on it; \
                     stopping (unpublished rows stay in the table)"
                );
                return Some(crate::Error::new(
                    ErrorKind::ClientClosed,
                    "the NATS client was closed under the relay (drained, or its connection task \
                     ended): build a new client and run again",
                ));
            }
        }
    }

    /// Sets the `_up` gauges from the last known states.
    pub(super) fn report_health(&self) {
        metrics::database_up(self.db_up.load(Ordering::Relaxed));
        metrics::broker_up(self.broker_up.load(Ordering::Relaxed) && self.sink.is_available());
    }
}
