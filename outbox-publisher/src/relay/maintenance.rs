//! The relay's background upkeep: backlog gauges, retention, and vacuuming
//! the rows that marking leaves dead.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::Relay;
use crate::error::Result;
use crate::metrics;
use crate::sink::Sink;

impl<S: Sink> Relay<S> {
    pub(super) async fn stats_loop(&self, shutdown: &CancellationToken) {
        while !shutdown.is_cancelled() {
            match self.store.stats(self.config.max_attempts).await {
                Ok(stats) => metrics::stats(&stats),
                Err(e) => debug!(error = %e, "reading backlog failed"),
            }
            tokio::select! {
                () = tokio::time::sleep(self.config.stats_interval) => {}
                () = shutdown.cancelled() => {}
            }
        }
    }

    /// Vacuums the table once enough rows were marked (see
    /// [`RelayConfig::vacuum_every`]), so dead index entries do not pile up
    /// between autovacuum visits.
    pub(super) async fn vacuum_loop(&self, shutdown: &CancellationToken) {
        let Some(threshold) = self.config.vacuum_every else {
            return;
        };
        let mut last: Option<Instant> = None;
        while !shutdown.is_cancelled() {
            let due = self.marked_since_vacuum.load(Ordering::Relaxed) >= threshold
                && last.is_none_or(|t| t.elapsed() >= self.config.vacuum_min_interval);
            if due {
                self.marked_since_vacuum.store(0, Ordering::Relaxed);
                let started = Instant::now();
                last = Some(started);
                match self.store.vacuum().await {
                    Ok(()) => {
                        metrics::vacuumed(started.elapsed());
                        debug!(took = ?started.elapsed(), "vacuumed outbox_events");
                    }
                    Err(e) => debug!(error = %e, "vacuum failed"),
                }
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = shutdown.cancelled() => {}
            }
        }
    }

    pub(super) async fn prune_loop(&self, shutdown: &CancellationToken) {
        if self.config.retention.is_none() {
            return;
        }
        while !shutdown.is_cancelled() {
            if let Err(e) = self.prune().await {
                warn!(error = %e, "pruning published outbox rows failed; retrying at the next interval");
            }
            tokio::select! {
                () = tokio::time::sleep(self.config.prune_interval) => {}
                () = shutdown.cancelled() => {}
            }
        }
    }

    /// Deletes published rows older than the retention window, in batches;
    /// returns how many. Unpublished rows are never deleted.
    ///
    /// # Errors
    /// [`ErrorKind::Database`](crate::ErrorKind::Database) if a delete fails.
    pub async fn prune(&self) -> Result<u64> {
        let Some(window) = self.config.retention else {
            return Ok(0);
        };
        let mut total = 0;
        loop {
            let n = self.store.prune(window, self.config.prune_batch).await?;
            total += n;
            metrics::pruned(n);
            if n < u64::try_from(self.config.prune_batch).unwrap_or(0) {
                break;
            }
        }
        if total > 0 {
            info!(deleted = total, "pruned published outbox rows");
        }
        Ok(total)
    }
}
