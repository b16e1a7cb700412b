//! The publisher loops: each worker checks out its part of the owned shards,
//! runs a batch, and goes straight on while there is work, or waits for a
//! wake-up (a commit's NOTIFY, a change of owned shards) or the poll interval.

use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::{BatchReport, Relay};
use crate::backoff::LoopBackoff;
use crate::error::{ErrorKind, Result};
use crate::sink::Sink;

/// Consecutive batches without progress after which `drain` gives up on rows
/// that are neither published nor failed (not counting broker faults).
const DRAIN_STALLS: usize = 20;
/// How long a drain waits, with rows left in shards other relays own, for one
/// of them to get published before it gives up.
pub(crate) const DRAIN_PATIENCE: Duration = Duration::from_secs(60);
/// How often a drain looks again at the rows left in other relays' shards.
const DRAIN_RECHECK: Duration = Duration::from_millis(200);

impl<S: Sink> Relay<S> {
    pub(super) async fn worker(
        &self,
        mut wake: watch::Receiver<u64>,
        shutdown: &CancellationToken,
    ) {
        let mut owned = self.shards.subscribe();
        let mut idle = LoopBackoff::new(Duration::from_millis(100), Duration::from_secs(10));
        // Consecutive empty batches: a worker sleeps only once it has found
        // every part of the owned shards empty, not just its last one.
        let mut empty = 0;
        while !shutdown.is_cancelled() {
            wake.borrow_and_update();
            owned.borrow_and_update();
            let pause = if self.sink.is_available() {
                let checkout = self.shards.checkout(self.config.workers);
                if checkout.is_empty() {
                    Some(self.config.poll_interval)
                } else {
                    let result = self.run_batch(&checkout).await;
                    drop(checkout);
                    self.note_db_health(&result);
                    self.note_broker_idle(&result);
                    self.report_health();
                    empty = match &result {
                        Ok(report) if report.claimed == 0 => empty + 1,
                        _ => 0,
                    };
                    match result {
                        Ok(report) if report.claimed == 0 => {
                            idle.reset();
                            (empty >= self.config.workers).then_some(self.config.poll_interval)
                        }
                        Ok(report) if report.progress() == 0 && report.broker_faults > 0 => {
                            Some(idle.next())
                        }
                        Ok(report) if report.progress() == 0 => Some(self.config.poll_interval),
                        // Progress: more may be waiting, go straight on.
                        Ok(_) => {
                            idle.reset();
                            None
                        }
                        Err(_) => Some(idle.next()),
                    }
                }
            } else {
                self.note_broker_health(0, 1, Some("not connected to NATS"));
                self.report_health();
                Some(idle.next())
            };
            if let Some(pause) = pause {
                empty = 0;
                tokio::select! {
                    _ = wake.changed() => {}
                    _ = owned.changed() => {}
                    () = tokio::time::sleep(pause) => {}
                    () = shutdown.cancelled() => {}
                }
            }
        }
    }

    /// Publishes every row due when it starts, in every shard, and returns
    /// the totals; prunes once if retention is on. Rows in backoff, parked
    /// or skipped are not waited for; a broker that is down is.
    ///
    /// Alone, a relay owns every shard and drains the whole table. Beside
    /// other relays (a long-running one, or another drain started by an
    /// overlapping cron job) it drains its share, then waits while the
    /// others publish theirs, taking over the shards they let go of, until
    /// no row that was due is left anywhere.
    ///
    /// # Errors
    /// [`ErrorKind::Database`] if a claim or mark
    /// fails; [`ErrorKind::Stalled`] when rows were
    /// left for 60 s without one of them getting published (the message
    /// counts them and names their shards).
    pub async fn drain(&self) -> Result<BatchReport> {
        let stop = CancellationToken::new();
        self.shards.reset_changes();
        let work = async {
            let result = self.drain_table().await;
            stop.cancel();
            result
        };
        let (result, ()) = tokio::join!(work, self.shards.maintain(&stop));
        let total = result?;
        if self.config.retention.is_some() {
            self.prune().await?;
        }
        Ok(total)
    }

    /// Drains the owned shards until no row due at the start is left in any
    /// shard, or none got published for `DRAIN_PATIENCE`.
    async fn drain_table(&self) -> Result<BatchReport> {
        let start_seq = self.store.tick(None).await?.last_seq;
        let mut total = BatchReport::default();
        let mut best = i64::MAX;
        let mut progressed = Instant::now();
        loop {
            total.add(self.drain_owned().await?);
            let left = self
                .store
                .drain_left(start_seq, self.config.max_attempts)
                .await?;
            if left.rows == 0 {
                return Ok(total);
            }
            if left.rows < best {
                best = left.rows;
                progressed = Instant::now();
            } else if progressed.elapsed() >= DRAIN_PATIENCE {
                return Err(crate::Error::new(
                    crate::ErrorKind::Stalled,
                    format!(
                        "the drain left {} due rows unpublished in shards {:?}: none of them was \
                         published for {} (a relay owning those shards is stuck, \
                         or they are refused); `outboxctl status` shows who holds what",
                        left.rows,
                        left.shards,
                        outbox_pg::HumanDuration(DRAIN_PATIENCE)
                    ),
                ));
            }
            let owned = self.shards.owned();
            if !left.shards.iter().any(|s| owned.contains(s)) {
                // Theirs: wait for their owners, or for the shards to be free.
                tokio::time::sleep(DRAIN_RECHECK).await;
            }
        }
    }

    async fn drain_owned(&self) -> Result<BatchReport> {
        let mut owned = self.shards.subscribe();
        while *owned.borrow_and_update() == 0 {
            if owned.changed().await.is_err() {
                return Ok(BatchReport::default());
            }
        }
        // The workers in parallel, then one pass over every owned shard: a
        // worker stops when its part is empty, which says nothing of the others.
        let workers = self.config.workers;
        let mut total = BatchReport::default();
        for report in
            futures::future::join_all((0..workers).map(|_| self.drain_part(workers))).await
        {
            total.add(report?);
        }
        total.add(self.drain_part(1).await?);
        Ok(total)
    }

    /// Runs batches over `1 / parts` of the owned shards until one is empty.
    async fn drain_part(&self, parts: usize) -> Result<BatchReport> {
        let mut total = BatchReport::default();
        let mut idle = LoopBackoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut stalls = 0;
        loop {
            let checkout = self.shards.checkout(parts);
            if checkout.is_empty() {
                return Ok(total);
            }
            let report = self.run_batch(&checkout).await?;
            drop(checkout);
            total.add(report);
            if report.claimed == 0 {
                return Ok(total);
            }
            if report.progress() > 0 {
                stalls = 0;
                idle.reset();
            } else if report.broker_faults > 0 {
                tokio::time::sleep(idle.next()).await;
            } else {
                stalls += 1;
                if stalls >= DRAIN_STALLS {
                    return Ok(total);
                }
            }
        }
    }

    pub(super) fn note_broker_health(&self, published: usize, faults: usize, error: Option<&str>) {
        use std::sync::atomic::Ordering;
        if published == 0 && faults > 0 && self.broker_up.swap(false, Ordering::Relaxed) {
            warn!(
                error = error.unwrap_or_default(),
                "broker unavailable; rows wait, without losing attempts, until it is back"
            );
        } else if published > 0 && !self.broker_up.swap(true, Ordering::Relaxed) {
            info!("publishing recovered");
        }
    }

    pub(super) fn note_db_health(&self, result: &Result<BatchReport>) {
        use std::sync::atomic::Ordering;
        match result {
            // Not an outage: said every time (the backoff spaces it out)
            // until an operator grants what is missing.
            Err(e) if e.kind() == ErrorKind::Privilege => {
                self.db_up.store(false, Ordering::Relaxed);
                error!(error = %e, "the relay's database role lacks a privilege; retrying with backoff until it is granted");
            }
            Err(e) if self.db_up.swap(false, Ordering::Relaxed) => {
                warn!(error = %e, "outbox database unavailable; retrying with backoff");
            }
            Ok(_) if !self.db_up.swap(true, Ordering::Relaxed) => {
                info!("outbox database available again");
            }
            _ => {}
        }
    }
}
