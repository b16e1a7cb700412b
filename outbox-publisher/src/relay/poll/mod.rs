//! The polling source: rows claimed from the table, shard by shard, from
//! each shard's cursor (the main lane) and from the retry lane. Its workers
//! each check out their part of the owned shards, run a batch
//! ([`batch`]), and go straight on while there is work, or wait for a
//! wake-up (a commit's NOTIFY, [`listen`](super::listen); a change of owned shards; another
//! source's hand-over) or the poll interval. It publishes through the
//! [`Engine`] and owns nothing else: the shards and the settled horizon are
//! the relay's, shared with the maintenance tasks and the WAL source.
//!
//! # The handle between the sources: [`MainLane`]
//!
//! Alone, the polling source reads every fresh row. Beside the WAL source it
//! serves the backfill (rows written before the slot) and the retry lane,
//! and its main lane stops at the seq the WAL source hands it: a value the
//! WAL source raises through its [`MainLaneLimit`] and the workers read once
//! per batch. Cursors never pass it, so rows above it stay readable here if
//! the WAL source hands them back (a lost slot: it raises the limit again).

use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::BatchReport;
use super::engine::Engine;
use super::horizon::Horizon;
use super::shards::Shards;
use crate::backoff::LoopBackoff;
use crate::error::Result;
use crate::sink::Sink;

mod batch;
mod sweep;

use self::sweep::Sweep;

/// Consecutive batches without progress after which `drain` gives up on rows
/// that are neither published nor failed (not counting broker faults).
const DRAIN_STALLS: usize = 20;
/// How long a drain waits, with rows left in shards other relays own, for one
/// of them to get published before it gives up.
const DRAIN_PATIENCE: Duration = Duration::from_secs(60);
/// How often a drain looks again at the rows left in other relays' shards.
const DRAIN_RECHECK: Duration = Duration::from_millis(200);

/// Where the polling source's main lane ends: the highest `seq` its claims
/// may read. Read by the workers once per batch.
#[derive(Debug, Clone)]
pub(crate) struct MainLane(watch::Receiver<i64>);

/// The other end of a [`MainLane`]: held by the source that publishes the
/// fresh rows above it (the WAL source).
#[derive(Debug)]
pub(crate) struct MainLaneLimit(watch::Sender<i64>);

impl MainLane {
    /// A main lane without end: the polling source reads every fresh row.
    pub(crate) fn open() -> Self {
        Self(watch::channel(i64::MAX).1)
    }

    /// A main lane closed (`-1`: no row) until its limit is raised.
    pub(crate) fn closed() -> (MainLaneLimit, Self) {
        let (limit, lane) = watch::channel(-1);
        (MainLaneLimit(limit), Self(lane))
    }

    /// The highest `seq` the main lane may read now.
    fn until(&self) -> i64 {
        *self.0.borrow()
    }
}

impl MainLaneLimit {
    /// Lets the main lane read up to `seq` (never lowers it).
    pub(crate) fn raise(&self, seq: i64) {
        self.0.send_if_modified(|until| {
            let raised = seq > *until;
            if raised {
                *until = seq;
            }
            raised
        });
    }
}

/// The polling source of a relay (see the module docs).
#[derive(Debug)]
pub(crate) struct PollSource<'a, S> {
    engine: &'a Engine<S>,
    shards: &'a Shards,
    horizon: &'a Horizon,
    lane: MainLane,
    /// When the workers may sleep.
    sweep: Sweep,
}

impl<'a, S: Sink> PollSource<'a, S> {
    /// The polling source over `shards`, its main lane ending at `lane`.
    pub(crate) fn new(
        engine: &'a Engine<S>,
        shards: &'a Shards,
        horizon: &'a Horizon,
        lane: MainLane,
    ) -> Self {
        Self {
            engine,
            shards,
            horizon,
            lane,
            sweep: Sweep::default(),
        }
    }

    /// The workers, until `shutdown`; each wakes up early when `wake` changes.
    pub(crate) async fn run(&self, wake: &watch::Receiver<u64>, shutdown: &CancellationToken) {
        futures::future::join_all(
            (0..self.engine.config.workers).map(|_| self.worker(wake.clone(), shutdown)),
        )
        .await;
    }

    /// One worker's loop.
    async fn worker(&self, mut wake: watch::Receiver<u64>, shutdown: &CancellationToken) {
        let mut owned = self.shards.subscribe();
        let mut more = self.sweep.subscribe();
        let mut idle = LoopBackoff::new(Duration::from_millis(100), Duration::from_secs(10));
        while !shutdown.is_cancelled() {
            let woken = *wake.borrow_and_update();
            owned.borrow_and_update();
            more.borrow_and_update();
            let pause = if self.engine.sink.is_available() {
                let checkout = self.shards.checkout(self.engine.config.workers);
                if checkout.is_empty() {
                    Some(self.engine.config.poll_interval)
                } else {
                    self.sweep.claiming(woken);
                    let (result, to_end) = match self.run_batch(&checkout).await {
                        Ok(ran) => (Ok(ran.report), ran.to_end),
                        Err(e) => (Err(e), false),
                    };
                    drop(checkout);
                    self.engine.note_db_health(&result);
                    self.engine.note_broker_idle(&result);
                    self.engine.report_health();
                    self.after(&result, to_end, &mut idle)
                }
            } else {
                self.engine
                    .note_broker_health(0, 1, Some("not connected to NATS"));
                self.engine.report_health();
                Some(idle.next())
            };
            if let Some(pause) = pause {
                tokio::select! {
                    _ = wake.changed() => {}
                    _ = owned.changed() => self.sweep.restart(),
                    _ = more.changed() => {}
                    () = tokio::time::sleep(pause) => self.sweep.restart(),
                    () = shutdown.cancelled() => {}
                }
            }
        }
    }

    /// How long a worker pauses after a batch (`to_end`:
    /// it read its part to the end): not at all
    /// while there is more to read; the poll interval once the workers have
    /// read every part to its end since the wake-up ([`Sweep`]), or made no
    /// progress; a growing backoff after faults.
    fn after(
        &self,
        result: &Result<BatchReport>,
        to_end: bool,
        idle: &mut LoopBackoff,
    ) -> Option<Duration> {
        let interval = self.engine.config.poll_interval;
        let workers = self.engine.config.workers;
        match result {
            Ok(report) if report.progress() == 0 && report.broker_faults > 0 => {
                self.sweep.claimed(false, false, workers);
                Some(idle.next())
            }
            Ok(_) if to_end => {
                idle.reset();
                self.sweep.claimed(true, false, workers).then_some(interval)
            }
            Ok(report) if report.progress() == 0 => {
                self.sweep.claimed(false, false, workers);
                Some(interval)
            }
            // More may be waiting: go straight on, and wake the others.
            Ok(_) => {
                idle.reset();
                self.sweep.claimed(false, true, workers);
                None
            }
            Err(_) => {
                self.sweep.claimed(false, false, workers);
                Some(idle.next())
            }
        }
    }

    /// Publishes every row due when it starts, in every shard, holding the
    /// shards meanwhile (see [`Relay::drain`](super::Relay::drain)).
    ///
    /// # Errors
    /// As [`Relay::drain`](super::Relay::drain).
    pub(crate) async fn drain(&self) -> Result<BatchReport> {
        let stop = CancellationToken::new();
        self.shards.reset_changes();
        let work = async {
            let result = self.drain_table().await;
            stop.cancel();
            result
        };
        let (result, ()) = tokio::join!(work, self.shards.maintain(&stop));
        result
    }

    /// Drains the owned shards until no row due at the start is left in any
    /// shard, or none got published for `DRAIN_PATIENCE`.
    async fn drain_table(&self) -> Result<BatchReport> {
        let start_seq = self.engine.store.tick(None).await?.last_seq;
        let mut total = BatchReport::default();
        let mut best = i64::MAX;
        let mut progressed = Instant::now();
        loop {
            total.add(self.drain_owned().await?);
            let left = self
                .engine
                .store
                .drain_left(start_seq, self.engine.config.max_attempts)
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
        let workers = self.engine.config.workers;
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
            let report = self.run_batch(&checkout).await?.report;
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
}
