//! The relay's background upkeep: backlog and reachability gauges, retention,
//! and the sink's periodic re-read of the stream.

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::engine::Engine;
use super::shards::Shards;
use crate::error::Result;
use crate::metrics;
use crate::sink::Sink;

/// The scheduled rows are counted once per this many backlog readings
/// (every minute at the default `stats_interval` of 5 s).
const SCHEDULED_EVERY: u32 = 12;

impl<S: Sink> Engine<S> {
    /// Every `stats_interval`, the reachability gauges and, on the owner of
    /// shard 0 among `shards`' relays, the backlog gauges; every
    /// [`SCHEDULED_EVERY`] of those, the count of scheduled rows (its cost
    /// grows with them).
    pub(super) async fn stats_loop(&self, shards: &Shards, shutdown: &CancellationToken) {
        let mut ticks = 0_u32;
        while !shutdown.is_cancelled() {
            // Every relay reports its own reachability.
            self.probe_database(!shards.owned().is_empty()).await;
            self.report_health();
            // One relay reports the table-wide figures: the owner of shard 0.
            if shards.owned().contains(&0) {
                match self.store.stats(self.config.max_attempts).await {
                    Ok(stats) => metrics::stats(&stats),
                    Err(e) => debug!(error = %e, "reading backlog failed"),
                }
                if ticks.is_multiple_of(SCHEDULED_EVERY) {
                    match self.store.scheduled_count().await {
                        Ok(rows) => metrics::scheduled(rows),
                        Err(e) => debug!(error = %e, "counting scheduled rows failed"),
                    }
                }
                ticks = ticks.wrapping_add(1);
            }
            tokio::select! {
                () = tokio::time::sleep(self.config.stats_interval) => {}
                () = shutdown.cancelled() => {}
            }
        }
    }

    /// Every `stream_refresh`, the sink reads the stream's config again
    /// ([`Sink::refresh`]), so edits made while the relay runs are followed
    /// even when no row asks.
    pub(super) async fn stream_refresh_loop(&self, shutdown: &CancellationToken) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(self.config.stream_refresh) => {}
                () = shutdown.cancelled() => return,
            }
            tokio::select! {
                () = self.sink.refresh() => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    /// Every `prune_interval`, [`prune`](Self::prune) (with retention on).
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
    pub(super) async fn prune(&self) -> Result<u64> {
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
