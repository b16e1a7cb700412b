//! The `_up` gauges: what the relay last saw of its database and its broker,
//! exported as `outbox_relay_database_up` and `outbox_relay_broker_up` (1/0)
//! after every batch and every `stats_interval`.
//!
//! The states are the engine's ([`Health`]), noted by whoever publishes or
//! writes (`note_db_health`, `note_broker_health`: the polling workers, the
//! WAL pipeline), which log each change once. The broker counts as
//! up while NATS is connected and the last publishes were acked; a batch that
//! finds nothing to publish while connected brings it back up, so an idle
//! relay does not stay "down" after an outage it had nothing to publish in.
//! A relay that runs no batches (it holds no shards, which is what a lost
//! database session leads to, or the broker is down) pings its database
//! every `stats_interval` instead, so the database gauge still follows.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::BatchReport;
use super::Engine;
use crate::error::{ErrorKind, Result};
use crate::metrics;
use crate::sink::Sink;

/// Bound on the database ping of an idle relay.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a relay whose broker is down asks whether its client is closed.
const CLOSED_CHECK: Duration = Duration::from_secs(1);

/// What the relay last saw of its database and its broker.
#[derive(Debug)]
pub(crate) struct Health {
    broker_up: AtomicBool,
    db_up: AtomicBool,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            broker_up: AtomicBool::new(true),
            db_up: AtomicBool::new(true),
        }
    }
}

impl<S: Sink> Engine<S> {
    /// After a batch: an empty one while connected means the broker is fine.
    pub(in crate::relay) fn note_broker_idle(&self, result: &Result<BatchReport>) {
        if matches!(result, Ok(report) if report.claimed == 0)
            && self.sink.is_available()
            && !self.health.broker_up.swap(true, Ordering::Relaxed)
        {
            info!("broker connected again; no fresh row was waiting to publish");
        }
    }

    /// Pings the database if no batch does it for us (no shards held, or
    /// the broker down), bounded by [`PROBE_TIMEOUT`], and notes the result.
    pub(in crate::relay) async fn probe_database(&self, holds_shards: bool) {
        if holds_shards && self.sink.is_available() {
            return;
        }
        let check = outbox_pg::health::database(self.store.pool(), PROBE_TIMEOUT).await;
        let up = check.ok();
        if self.health.db_up.swap(up, Ordering::Relaxed) != up {
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
    pub(in crate::relay) async fn client_watch(
        &self,
        shutdown: &CancellationToken,
    ) -> Option<crate::Error> {
        loop {
            tokio::select! {
                () = tokio::time::sleep(CLOSED_CHECK) => {}
                () = shutdown.cancelled() => return None,
            }
            let down = !self.health.broker_up.load(Ordering::Relaxed) || !self.sink.is_available();
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
    pub(crate) fn report_health(&self) {
        metrics::database_up(self.health.db_up.load(Ordering::Relaxed));
        metrics::broker_up(
            self.health.broker_up.load(Ordering::Relaxed) && self.sink.is_available(),
        );
    }

    /// After publishing: the broker is down when nothing was published and
    /// some publish met a fault, up again once something is.
    pub(crate) fn note_broker_health(&self, published: usize, faults: usize, error: Option<&str>) {
        if published == 0 && faults > 0 && self.health.broker_up.swap(false, Ordering::Relaxed) {
            warn!(
                error = error.unwrap_or_default(),
                "broker unavailable; rows wait, without losing attempts, until it is back"
            );
        } else if published > 0 && !self.health.broker_up.swap(true, Ordering::Relaxed) {
            info!("publishing recovered");
        }
    }

    /// After a batch or a write: the database's state, each change logged
    /// once (a missing privilege every time).
    pub(crate) fn note_db_health(&self, result: &Result<BatchReport>) {
        match result {
            // Not an outage: said every time (the backoff spaces it out)
            // until an operator grants what is missing.
            Err(e) if e.kind() == ErrorKind::Privilege => {
                self.health.db_up.store(false, Ordering::Relaxed);
                error!(error = %e, "the relay's database role lacks a privilege; retrying with backoff until it is granted");
            }
            Err(e) if self.health.db_up.swap(false, Ordering::Relaxed) => {
                warn!(error = %e, "outbox database unavailable; retrying with backoff");
            }
            Ok(_) if !self.health.db_up.swap(true, Ordering::Relaxed) => {
                info!("outbox database available again");
            }
            _ => {}
        }
    }
}
