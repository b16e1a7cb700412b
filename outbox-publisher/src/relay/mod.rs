//! The publisher loop: claim → publish → mark, with per-subject ordering across
//! any number of replicas.
//!
//! # Claim with a lease, publish outside any transaction
//!
//! A batch is claimed by one short statement (`queries/claim.sql`) that sets
//! `locked_until = now() + lease` on the rows it takes and commits. The relay
//! then publishes with no transaction open and no row lock held, each publish
//! bounded by the publish timeout, and marks the outcome in a second short
//! statement per kind: every acked id in one `UPDATE`, every failure in one.
//! A relay killed at any point leaves its rows unpublished with a lease that
//! runs out, after which any replica claims them again and republishes with the
//! same `Nats-Msg-Id`, which the stream's duplicate window drops.
//!
//! # Ordering: a gap-free prefix per subject
//!
//! An event is published only if every earlier unpublished event of its
//! envelope `subject` is in the same claim. The claim statement computes, per
//! subject among the candidates, the first unpublished row that is *not* a
//! candidate — one that failed and waits in backoff, sits past the attempt cap,
//! or is leased by another replica — and accepts only candidates before it.
//! The check reads the table, not any in-memory state, so it holds across
//! replicas, restarts and lease expiry: two replicas can never hold events of
//! one subject at once unless all earlier ones are published. Within a batch,
//! the events of one subject are published one after the other, each waiting
//! for its PubAck, and the first failure stops the rest of that subject
//! (they are released, and the failed row's backoff holds them back). Different
//! subjects are published concurrently (up to `max_in_flight`).
//!
//! A row that can never be published (invalid subject, over the broker's max
//! payload) goes straight to the cap and blocks only its own subject; rows
//! queued behind a blocked subject are deferred so they do not fill every batch.
//!
//! # Latency
//!
//! The migration's statement trigger sends `NOTIFY outbox_events` on every
//! insert; the relay `LISTEN`s and claims as soon as a transaction commits.
//! Polling (`poll_interval`) covers lost notifications.
//!
//! # Faults
//!
//! Per-row failures get exponential backoff with jitter and count toward the
//! cap. While the broker is down the loop itself backs off too, and logs once
//! per state change, not once per row. Database errors back the loop off the
//! same way; nothing is lost, only delayed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use outbox_core::{Envelope, EventId};
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};
use uuid::Uuid;

use crate::backoff::{Backoff, LoopBackoff};
use crate::config::RelayConfig;
use crate::error::Result;
use crate::metrics;
use crate::sink::{FailureKind, JetStreamSink, OutgoingMessage, PublishFailure, Sink};
use crate::store::{ClaimedRow, Failure, Store};
use crate::stream::StreamSpec;

mod listen;
mod maintenance;

/// The channel the migration's trigger notifies on every insert.
pub const NOTIFY_CHANNEL: &str = "outbox_events";

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows acked by the broker and marked published (duplicates included).
    pub published: usize,
    /// Of those, acks flagged duplicate (a republish the stream dropped).
    pub duplicates: usize,
    /// Rows whose publish failed (recorded on the row, retried after backoff).
    pub failed: usize,
    /// Rows given back untried (behind a failure of their subject, or out of time).
    pub released: usize,
}

impl BatchReport {
    fn add(&mut self, other: BatchReport) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.duplicates += other.duplicates;
        self.failed += other.failed;
        self.released += other.released;
    }
}

/// The relay. Run any number of them against one table.
#[derive(Debug)]
pub struct Relay<S = JetStreamSink> {
    store: Store,
    sink: S,
    config: RelayConfig,
    backoff: Backoff,
    broker_up: AtomicBool,
    db_up: AtomicBool,
    marked_since_vacuum: AtomicU64,
}

impl Relay<JetStreamSink> {
    /// A relay publishing to JetStream through `client`, after creating or
    /// verifying `stream`.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) for an invalid config;
    /// [`ErrorKind::Stream`](crate::ErrorKind::Stream) /
    /// [`ErrorKind::Broker`](crate::ErrorKind::Broker) from [`StreamSpec::ensure`].
    pub async fn jetstream(
        pool: PgPool,
        client: async_nats::Client,
        stream: &StreamSpec,
        config: RelayConfig,
    ) -> Result<Self> {
        config.validate()?;
        let sink = JetStreamSink::new(client, config.publish_timeout).expect_stream(stream.name());
        stream.ensure(sink.context()).await?;
        Self::new(pool, sink, config)
    }

    /// Sets up a JetStream relay as [`Relay::jetstream`] does and runs it until
    /// `shutdown` is cancelled, for a service that runs its relay in-process.
    /// The service must not depend on the broker being up when it starts, so
    /// a set-up failure (NATS not reachable yet, the stream missing or not
    /// matching `stream`) is logged and retried with backoff (0.5 s doubling
    /// to 10 s) instead of returned; events wait in the table meanwhile.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) if `config` is invalid;
    /// nothing else: every other failure is retried.
    pub async fn run_jetstream(
        pool: PgPool,
        client: async_nats::Client,
        stream: StreamSpec,
        config: RelayConfig,
        shutdown: CancellationToken,
    ) -> Result<()> {
        config.validate()?;
        let mut retry = LoopBackoff::new(Duration::from_millis(500), Duration::from_secs(10));
        let relay = loop {
            let attempt = Self::jetstream(pool.clone(), client.clone(), &stream, config.clone());
            let result = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                result = attempt => result,
            };
            match result {
                Ok(relay) => break relay,
                Err(e) => {
                    let pause = retry.next();
                    warn!(stream = stream.name(), error = %e, retry_in = ?pause, "relay set-up failed; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(()),
                        () = tokio::time::sleep(pause) => {}
                    }
                }
            }
        };
        relay.run(shutdown).await
    }
}

impl<S: Sink> Relay<S> {
    /// A relay publishing to `sink`.
    ///
    /// # Errors
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) if `config` is invalid.
    pub fn new(pool: PgPool, sink: S, config: RelayConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            store: Store::new(pool),
            sink,
            backoff: Backoff::new(config.backoff_base, config.backoff_max),
            config,
            broker_up: AtomicBool::new(true),
            db_up: AtomicBool::new(true),
            marked_since_vacuum: AtomicU64::new(0),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// Runs until `shutdown` is cancelled: the publisher loop, the LISTEN
    /// wake-ups, the backlog gauges and the pruner. On shutdown the current batch
    /// is finished (every publish in it is bounded) and marked, then `run`
    /// returns `Ok`.
    ///
    /// # Errors
    /// None today: database and broker failures are retried with backoff, not
    /// returned. The `Result` is kept for fatal errors to come.
    pub async fn run(&self, shutdown: CancellationToken) -> Result<()> {
        let wake = Notify::new();
        info!(
            batch_size = self.config.batch_size,
            poll_interval = ?self.config.poll_interval,
            max_attempts = self.config.max_attempts,
            "outbox relay started"
        );
        tokio::join!(
            futures::future::join_all(
                (0..self.config.workers).map(|_| self.publish_loop(&wake, &shutdown))
            ),
            self.listen_loop(&wake, &shutdown),
            self.stats_loop(&shutdown),
            self.prune_loop(&shutdown),
            self.vacuum_loop(&shutdown),
        );
        info!("outbox relay stopped");
        Ok(())
    }

    /// Publishes batches until nothing is left to claim, prunes once if
    /// retention is on, and returns the totals. Rows in backoff are not waited for.
    ///
    /// # Errors
    /// [`ErrorKind::Database`](crate::ErrorKind::Database) if a claim or mark fails.
    pub async fn drain(&self) -> Result<BatchReport> {
        let loops = (0..self.config.workers).map(|_| async {
            let mut total = BatchReport::default();
            loop {
                let report = self.publish_batch().await?;
                total.add(report);
                if report.claimed == 0 {
                    return Ok::<_, crate::Error>(total);
                }
            }
        });
        let mut total = BatchReport::default();
        for report in futures::future::join_all(loops).await {
            total.add(report?);
        }
        // Two loops claiming at the same instant can each see the other's rows
        // as gaps and both come back empty-handed; one loop alone cannot, so
        // finish with one.
        loop {
            let report = self.publish_batch().await?;
            total.add(report);
            if report.claimed == 0 {
                break;
            }
        }
        if self.config.retention.is_some() {
            self.prune().await?;
        }
        Ok(total)
    }

    /// Claims one batch, publishes it and marks the outcome.
    ///
    /// # Errors
    /// [`ErrorKind::Database`](crate::ErrorKind::Database) if the claim or a
    /// mark fails; rows already published then keep their lease and are
    /// republished (as duplicates) after it runs out.
    pub async fn publish_batch(&self) -> Result<BatchReport> {
        let rows = self
            .store
            .claim(
                self.config.batch_size,
                self.config.max_attempts,
                self.config.lease,
                self.config.backoff_max,
            )
            .await?;
        if rows.is_empty() {
            return Ok(BatchReport::default());
        }
        let span = info_span!(
            "outbox.batch",
            size = rows.len(),
            published = tracing::field::Empty,
            failed = tracing::field::Empty
        );
        let report = self.publish_rows(rows).instrument(span.clone()).await?;
        span.record("published", report.published);
        span.record("failed", report.failed);
        Ok(report)
    }

    async fn publish_rows(&self, rows: Vec<ClaimedRow>) -> Result<BatchReport> {
        let claimed = rows.len();
        metrics::batch(claimed);
        // Keep time to mark the outcome before the lease runs out.
        let deadline = Instant::now()
            + self
                .config
                .lease
                .saturating_sub(self.config.publish_timeout);
        let outcomes: Vec<SubjectOutcome> = futures::stream::iter(group_by_subject(rows))
            .map(|group| self.publish_subject(group, deadline))
            .buffer_unordered(self.config.max_in_flight)
            .collect()
            .await;

        let mut report = BatchReport {
            claimed,
            ..BatchReport::default()
        };
        let mut published = Vec::new();
        let mut failures = Vec::new();
        let mut released = Vec::new();
        for outcome in outcomes {
            report.duplicates += outcome.duplicates;
            published.extend(outcome.published);
            released.extend(outcome.released);
            failures.extend(outcome.failure);
        }
        report.published = published.len();
        report.failed = failures.len();
        report.released = released.len();
        self.note_broker_health(&report, &failures);

        let marked = self.store.mark_published(&published).await?;
        self.marked_since_vacuum
            .fetch_add(marked, Ordering::Relaxed);
        let capped = self
            .store
            .mark_failed(&failures, self.config.max_attempts)
            .await?;
        for row in &capped {
            error!(
                event_id = %row.id,
                subject = %row.subject,
                event_type = %row.event_type,
                attempts = row.attempts,
                last_error = row.last_error.as_deref().unwrap_or_default(),
                "outbox row reached the attempt cap and is left alone; its subject is blocked until an operator resets it"
            );
        }
        metrics::capped(capped.len());
        self.store.release(&released).await?;
        Ok(report)
    }

    /// Publishes one subject's rows in order, stopping at the first failure.
    async fn publish_subject(&self, rows: Vec<ClaimedRow>, deadline: Instant) -> SubjectOutcome {
        let mut outcome = SubjectOutcome::default();
        let mut rows = rows.into_iter();
        for row in rows.by_ref() {
            if Instant::now() >= deadline {
                outcome.released.push(row.id);
                break;
            }
            let started = Instant::now();
            match self.publish_row(&row).await {
                Ok(duplicate) => {
                    let since_commit = (chrono::Utc::now() - row.created_at)
                        .to_std()
                        .unwrap_or_default();
                    metrics::published(&row.event_type, duplicate, started.elapsed(), since_commit);
                    if duplicate {
                        outcome.duplicates += 1;
                    }
                    outcome.published.push(row.id);
                }
                Err(failure) => {
                    metrics::failed(failure.kind());
                    debug!(event_id = %row.id, subject = %row.subject, error = %failure, "publish failed");
                    let attempt = u32::try_from(row.attempts).unwrap_or(0).saturating_add(1);
                    outcome.failure = Some(Failure {
                        id: row.id,
                        error: failure.to_string(),
                        retry_in: self.backoff.delay(attempt),
                        permanent: failure.kind().is_permanent(),
                    });
                    break;
                }
            }
        }
        outcome.released.extend(rows.map(|r| r.id));
        outcome
    }

    /// Publishes one row; `Ok(true)` if the stream already had it.
    async fn publish_row(&self, row: &ClaimedRow) -> std::result::Result<bool, PublishFailure> {
        let message = to_message(row)?;
        self.sink.publish(message).await.map(|ack| ack.duplicate)
    }

    fn note_broker_health(&self, report: &BatchReport, failures: &[Failure]) {
        let all_failed = report.published == 0 && report.failed > 0;
        if all_failed && self.broker_up.swap(false, Ordering::Relaxed) {
            let first = failures
                .first()
                .map(|f| f.error.as_str())
                .unwrap_or_default();
            warn!(
                failed = report.failed,
                error = first,
                "publishing failed; rows back off and are retried"
            );
        } else if report.published > 0 && !self.broker_up.swap(true, Ordering::Relaxed) {
            info!("publishing recovered");
        }
    }

    fn note_db_health(&self, result: &Result<BatchReport>) {
        match result {
            Err(e) if self.db_up.swap(false, Ordering::Relaxed) => {
                warn!(error = %e, "outbox database unavailable; retrying with backoff");
            }
            Ok(_) if !self.db_up.swap(true, Ordering::Relaxed) => {
                info!("outbox database available again");
            }
            _ => {}
        }
    }

    async fn publish_loop(&self, wake: &Notify, shutdown: &CancellationToken) {
        let mut idle_backoff =
            LoopBackoff::new(Duration::from_millis(100), Duration::from_secs(10));
        while !shutdown.is_cancelled() {
            let result = self.publish_batch().await;
            self.note_db_health(&result);
            let pause = match result {
                Ok(report) if report.claimed == 0 => {
                    idle_backoff.reset();
                    Some(self.config.poll_interval)
                }
                Ok(report) if report.published == 0 && report.failed > 0 => {
                    Some(idle_backoff.next())
                }
                Ok(report) => {
                    idle_backoff.reset();
                    // A full batch means more is waiting: go straight on.
                    (report.claimed < self.config.batch_size).then_some(self.config.poll_interval)
                }
                Err(_) => Some(idle_backoff.next()),
            };
            if let Some(pause) = pause {
                tokio::select! {
                    () = wake.notified() => {}
                    () = tokio::time::sleep(pause) => {}
                    () = shutdown.cancelled() => {}
                }
            }
        }
    }
}

/// The outcome of one subject's rows in a batch.
#[derive(Debug, Default)]
struct SubjectOutcome {
    published: Vec<Uuid>,
    duplicates: usize,
    failure: Option<Failure>,
    released: Vec<Uuid>,
}

/// Groups rows by subject, keeping created_at order within each group.
fn group_by_subject(rows: Vec<ClaimedRow>) -> Vec<Vec<ClaimedRow>> {
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut groups: Vec<Vec<ClaimedRow>> = Vec::new();
    for row in rows {
        match index.get(&row.subject) {
            Some(&i) => groups[i].push(row),
            None => {
                index.insert(row.subject.clone(), groups.len());
                groups.push(vec![row]);
            }
        }
    }
    groups
}

/// The message for a row: the CloudEvents JSON envelope on subject `event_type`.
fn to_message(row: &ClaimedRow) -> std::result::Result<OutgoingMessage, PublishFailure> {
    let invalid = |e: outbox_core::Error| PublishFailure::new(FailureKind::Invalid, e.to_string());
    let id = EventId::from_uuid(row.id);
    let envelope = Envelope::from_parts(
        id,
        row.event_type.as_str(),
        row.source.as_str(),
        row.subject.as_str(),
        row.time,
        &row.data,
    )
    .map_err(invalid)?;
    let envelope = match &row.traceparent {
        Some(tp) => envelope.with_trace_context(tp.clone(), row.tracestate.clone()),
        None => envelope,
    };
    let payload = envelope.to_json().map_err(invalid)?;
    Ok(OutgoingMessage {
        id,
        subject: row.event_type.clone(),
        payload: payload.into(),
        traceparent: row.traceparent.clone(),
        tracestate: row.tracestate.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(subject: &str, n: u8) -> ClaimedRow {
        ClaimedRow {
            id: Uuid::from_bytes([n; 16]),
            event_type: "a.b".into(),
            source: "svc".into(),
            subject: subject.into(),
            time: chrono::Utc::now(),
            data: serde_json::json!({}),
            created_at: chrono::Utc::now(),
            attempts: 0,
            traceparent: None,
            tracestate: None,
        }
    }

    #[test]
    fn groups_keep_order_within_a_subject() {
        let groups = group_by_subject(vec![row("x", 1), row("y", 2), row("x", 3), row("y", 4)]);
        let ids: Vec<Vec<u8>> = groups
            .iter()
            .map(|g| g.iter().map(|r| r.id.as_bytes()[0]).collect())
            .collect();
        assert_eq!(ids, [[1, 3], [2, 4]]);
    }

    #[test]
    fn invalid_rows_become_permanent_failures() {
        let mut bad = row("x", 1);
        bad.event_type = "has space".into();
        let err = to_message(&bad).unwrap_err();
        assert_eq!(err.kind(), FailureKind::Invalid);
        assert!(err.kind().is_permanent());
        assert!(err.to_string().contains("invalid event type"));
    }
}
