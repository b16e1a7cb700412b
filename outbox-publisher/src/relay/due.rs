//! The due source: scheduled rows (`due_at` set, see `outbox_pg::Due`),
//! published once each, at or after their time, through the [`Engine`].
//!
//! A scheduled row waits in the *due lane* (`outbox_events_due_idx`:
//! per shard, by `next_attempt_at`), out of the main and retry lanes, so the
//! polling and WAL sources never see it. This source, beside them in both
//! modes, owns it:
//!
//! - **Not early.** It takes a row only when `next_attempt_at <= now()` in
//!   PostgreSQL, and the table's trigger keeps `next_attempt_at` at or after
//!   `due_at` until the row is published. The relay's own clock decides
//!   nothing but how long to sleep.
//! - **Promptly, without polling.** Between batches it asks the database how
//!   long until the next row of its shards is due (one index probe per
//!   shard) and sleeps that long, capped at [`MAX_SLEEP`]; a transaction that
//!   schedules rows notifies the due channel at commit, which wakes it to
//!   ask again, as does a change of owned shards.
//! - **Once, across replicas and cancels.** It reads only the shards its
//!   relay owns, and takes rows in one short statement (`due_claim.sql`)
//!   that sets `released_at` (a cancel then answers "already published"),
//!   skipping rows a cancel holds. Published rows are marked from their
//!   PubAck as every row is; a failed row is backed off in the due lane,
//!   rows not tried are read again next turn. As for immediate rows, a
//!   shard's deposed owner may finish its batch while the new owner starts,
//!   and the stream's duplicate window stores a row both publish once; a
//!   relay killed mid-batch leaves its rows to the relay that takes over its
//!   shards, which publishes them at once (no lease to wait out).
//! - **Order.** Rows go out in due-time order, one subject's rows due at the
//!   same time in `seq` order (one chain, as the engine publishes every
//!   subject). They do not wait for, nor hold back, the subject's immediate
//!   rows: their messages carry `scheduledfor` in place of `sequence`.

use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::BatchReport;
use super::engine::Engine;
use super::listen::{self, Channel};
use super::shards::Shards;
use crate::backoff::LoopBackoff;
use crate::error::Result;
use crate::metrics;
use crate::sink::Sink;
use crate::store::DueRequest;

/// The longest the source sleeps without asking the database again: a
/// notification lost with its connection, or a row made due by hand, is
/// seen within this.
const MAX_SLEEP: Duration = Duration::from_secs(5);
/// The pause when rows are due but none could be taken (held by a cancel in
/// progress).
const HELD_PAUSE: Duration = Duration::from_millis(100);
/// How often a relay whose broker is not connected looks again: a local
/// check, so due rows go out as soon as it is back.
const BROKER_CHECK: Duration = Duration::from_millis(250);

/// The due source of a relay (see the module docs).
#[derive(Debug)]
pub(crate) struct DueSource<'a, S> {
    engine: &'a Engine<S>,
    shards: &'a Shards,
}

impl<'a, S: Sink> DueSource<'a, S> {
    pub(crate) fn new(engine: &'a Engine<S>, shards: &'a Shards) -> Self {
        Self { engine, shards }
    }

    /// Publishes due rows until `shutdown`, listening for newly scheduled
    /// ones.
    pub(crate) async fn run(&self, shutdown: &CancellationToken) {
        let (wake, wake_rx) = watch::channel(0_u64);
        tokio::join!(
            async {
                if self.engine.config.listen {
                    listen::listen_loop(self.engine.store.pool(), Channel::Due, &wake, shutdown)
                        .await;
                }
            },
            self.publish_loop(wake_rx, shutdown),
        );
    }

    /// Batches while rows are due, then sleeps until the next one is.
    async fn publish_loop(&self, mut wake: watch::Receiver<u64>, shutdown: &CancellationToken) {
        let mut owned = self.shards.subscribe();
        let mut idle = LoopBackoff::new(Duration::from_millis(100), Duration::from_secs(2));
        while !shutdown.is_cancelled() {
            wake.borrow_and_update();
            owned.borrow_and_update();
            let pause = self.step(&mut idle).await;
            if pause.is_zero() {
                continue;
            }
            tokio::select! {
                _ = wake.changed() => {}
                _ = owned.changed() => {}
                () = tokio::time::sleep(pause) => {}
                () = shutdown.cancelled() => {}
            }
        }
    }

    /// One turn: a batch if the broker is there, and how long to wait after
    /// it (zero: go straight on).
    async fn step(&self, idle: &mut LoopBackoff) -> Duration {
        let shards = self.shards.owned();
        if shards.is_empty() {
            return MAX_SLEEP;
        }
        if !self.engine.sink.is_available() {
            return BROKER_CHECK;
        }
        // Said as the polling source says it: an outage once, a missing
        // privilege every time (a due lane's failure is not only a debug line).
        let result = self.batch(&shards).await;
        self.engine.note_db_health(&result);
        let Ok(report) = result else {
            return idle.next();
        };
        if report.progress() == 0 && report.broker_faults > 0 {
            return idle.next();
        }
        idle.reset();
        if report.claimed >= self.engine.config.batch_size {
            return Duration::ZERO;
        }
        match self
            .engine
            .store
            .due_next(&shards, self.engine.config.max_attempts)
            .await
        {
            Ok(None) => MAX_SLEEP,
            Ok(Some(secs)) if secs <= 0.0 => {
                if report.progress() > 0 {
                    Duration::ZERO
                } else {
                    HELD_PAUSE
                }
            }
            // A millisecond past the due time: waking a hair early finds
            // nothing and asks again.
            Ok(Some(secs)) => Duration::from_secs_f64(secs.min(MAX_SLEEP.as_secs_f64()))
                .saturating_add(Duration::from_millis(1)),
            Err(e) => {
                debug!(error = %e, "reading the next due time failed");
                idle.next()
            }
        }
    }

    /// Takes the due rows of `shards`, publishes them and records the
    /// outcomes.
    async fn batch(&self, shards: &[i16]) -> Result<BatchReport> {
        let config = &self.engine.config;
        let max_payload = self.engine.sink.max_payload();
        let started = Instant::now();
        let rows = self
            .engine
            .store
            .due_claim(&DueRequest {
                shards,
                max_attempts: config.max_attempts,
                rows: config.batch_size,
                byte_budget: config.batch_bytes,
                max_message: max_payload,
            })
            .await?;
        metrics::phase("due_claim", started.elapsed());
        let mut report = BatchReport {
            claimed: rows.len(),
            ..BatchReport::default()
        };
        if rows.is_empty() {
            return Ok(report);
        }
        metrics::batch(rows.len());
        let deadline = started + config.lease.saturating_sub(config.publish_timeout);
        // Rows not tried stay due: the next turn reads them again.
        self.engine
            .publish_rows(rows, deadline, max_payload, &mut report)
            .await?;
        self.engine.report_health();
        Ok(report)
    }

    /// Publishes every due row of the owned shards until `stop` (the drain
    /// of [`Relay::drain`](super::Relay::drain), beside the polling source's).
    pub(crate) async fn drain(&self, stop: &CancellationToken) -> Result<BatchReport> {
        let mut total = BatchReport::default();
        let mut idle = LoopBackoff::new(Duration::from_millis(50), Duration::from_secs(2));
        while !stop.is_cancelled() {
            let shards = self.shards.owned();
            let report = if shards.is_empty() {
                BatchReport::default()
            } else {
                self.batch(&shards).await?
            };
            total.add(report);
            if report.progress() > 0 {
                idle.reset();
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep(idle.next()) => {}
                () = stop.cancelled() => {}
            }
        }
        Ok(total)
    }
}
