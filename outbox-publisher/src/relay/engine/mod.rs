//! The engine: what both sources share. Given rows (claimed by the polling
//! source, or read from the WAL), it validates each into a message, publishes
//! a subject's chain in order ([`chain`](chain)), records every
//! outcome and marks the published rows. It owns the store, the sink, the
//! backoff, the reachability states and the progress tally; it reads no rows
//! and moves no cursor or slot: that is each source's own business.
//!
//! Every row given to [`Engine::publish_rows`] ends in one of these states:
//! - **published**: acked by JetStream (a duplicate ack counts) and marked,
//!   with the ack's stream and sequence when the sink reports them;
//! - **failed**: refused for a reason of its own (recorded, backed off, or
//!   parked at once when it can never be published as it is);
//! - **deferred**: held back behind an earlier failed row of its subject and
//!   moved to the retry lane, due when that row is;
//! - **unresolved**: not tried (behind a broker fault or an unresolved row of
//!   its subject, past the byte budget, out of time). Nothing is written; the
//!   source reads it again.
//!
//! A broker fault (not connected, no ack in time, no stream answering) leaves
//! the row unresolved and costs it no attempt: only a refusal of the row
//! itself counts toward its cap. A row whose type the stream, read again,
//! does not capture is failed without counting an attempt: it waits in the
//! retry lane for `stream_refresh` and is tried again, until an operator
//! adds its subject to the stream (nothing to reset on the row). A row is
//! never marked before its PubAck.

mod chain;
pub(in crate::relay) mod progress;
mod reachability;

pub(crate) use chain::Outcome;

use std::collections::HashMap;
use std::time::Instant;

use futures::StreamExt;
use tracing::error;
use uuid::Uuid;

use self::progress::Tally;
use self::reachability::Health;
use super::message;
use crate::backoff::Backoff;
use crate::config::RelayConfig;
use crate::error::Result;
use crate::metrics;
use crate::sink::{PublishFailure, Sink};
use crate::store::{Blocker, ClaimedRow, Failure, Position, Store};

/// What one batch (or a drain) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Rows read.
    pub claimed: usize,
    /// Rows acked by the broker and marked published (duplicates included).
    pub published: usize,
    /// Of those, acks flagged duplicate (a republish the stream dropped).
    pub duplicates: usize,
    /// Rows refused for a reason of their own (recorded, backed off or parked).
    pub failed: usize,
    /// Rows moved to the retry lane behind an earlier failed row of their subject.
    pub deferred: usize,
    /// Rows left as they were, to be read again (behind a broker fault, past
    /// the byte budget, out of time).
    pub unresolved: usize,
    /// Publishes that failed because of the broker, not the row.
    pub broker_faults: usize,
}

impl BatchReport {
    pub(super) fn add(&mut self, other: BatchReport) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.duplicates += other.duplicates;
        self.failed += other.failed;
        self.deferred += other.deferred;
        self.unresolved += other.unresolved;
        self.broker_faults += other.broker_faults;
    }

    /// Rows that reached a new state.
    pub(super) fn progress(&self) -> usize {
        self.published + self.failed + self.deferred
    }
}

/// The shared publish engine (see the module docs).
#[derive(Debug)]
pub(crate) struct Engine<S> {
    pub(crate) store: Store,
    pub(crate) sink: S,
    pub(crate) config: RelayConfig,
    backoff: Backoff,
    /// What the relay last saw of its database and broker.
    pub(super) health: Health,
    /// Published since the last progress line.
    pub(super) tally: Tally,
}

/// Rows given to [`Engine::publish_rows`], sorted by what happens to them.
#[derive(Debug, Default)]
struct Sorted {
    /// Publishable rows, one chain per subject, each in `seq` order.
    chains: Vec<Vec<ClaimedRow>>,
    /// Rows behind a failed row of their subject, and when it is due.
    deferred: Vec<(Uuid, Option<chrono::DateTime<chrono::Utc>>)>,
    /// Rows not tried.
    unresolved: Vec<ClaimedRow>,
}

impl Sorted {
    /// Sorts `rows` (in `seq` order): over the byte budget or behind a row
    /// due now, unresolved; behind a failed row, deferred; else into their
    /// subject's chain.
    fn of(rows: Vec<ClaimedRow>) -> Self {
        let mut sorted = Self::default();
        let mut chain_of: HashMap<String, usize> = HashMap::new();
        for row in rows {
            if row.over_budget {
                sorted.unresolved.push(row);
                continue;
            }
            match row.blocker {
                Some(Blocker::Parked) => sorted.deferred.push((row.id, None)),
                Some(Blocker::Until(t)) => sorted.deferred.push((row.id, Some(t))),
                Some(Blocker::DueNow) => sorted.unresolved.push(row),
                None => {
                    let chains = &mut sorted.chains;
                    let i = *chain_of.entry(row.subject.clone()).or_insert_with(|| {
                        chains.push(Vec::new());
                        chains.len() - 1
                    });
                    chains[i].push(row);
                }
            }
        }
        sorted
    }
}

/// The outcomes of a batch's chains, by what is written for them.
#[derive(Debug, Default)]
struct Recorded {
    published: Vec<(Uuid, Option<Position>)>,
    /// Subjects of rows published out of the retry lane.
    woken: Vec<String>,
    failures: Vec<Failure>,
    broker_faults: usize,
    first_fault: Option<String>,
}

impl<S: Sink> Engine<S> {
    /// The engine of a relay.
    pub(super) fn new(store: Store, sink: S, config: RelayConfig) -> Self {
        Self {
            store,
            sink,
            backoff: Backoff::new(config.backoff_base, config.backoff_max),
            config,
            health: Health::default(),
            tally: Tally::default(),
        }
    }

    /// Publishes `rows` (in seq order) and records every outcome: rows
    /// blocked by an earlier row of their subject in the retry lane are
    /// deferred behind it, the others published per subject in order
    /// ([`publish_chain`](Self::publish_chain)), subjects side by side;
    /// published rows are marked, refused ones recorded (backed off or
    /// parked), followers of rows published out of the retry lane made due.
    /// Returns the rows left unresolved (past the byte budget, behind a
    /// broker fault or an unresolved row of their subject, out of time),
    /// with nothing written for them; `report` gets the counts.
    pub(crate) async fn publish_rows(
        &self,
        rows: Vec<ClaimedRow>,
        deadline: Instant,
        max_payload: usize,
        report: &mut BatchReport,
    ) -> Result<Vec<ClaimedRow>> {
        let Sorted {
            chains,
            deferred,
            mut unresolved,
        } = Sorted::of(rows);

        let started = Instant::now();
        let results: Vec<Vec<(ClaimedRow, Outcome)>> = futures::stream::iter(chains)
            .map(|chain| self.publish_chain(chain, deadline, max_payload))
            .buffer_unordered(self.config.max_in_flight)
            .collect()
            .await;
        metrics::phase("publish", started.elapsed());

        let mut recorded = Recorded::default();
        for (row, outcome) in results.into_iter().flatten() {
            match outcome {
                Outcome::Published {
                    duplicate,
                    position,
                } => {
                    recorded.published.push((row.id, position));
                    report.duplicates += usize::from(duplicate);
                    if let Some(late) = row.late_secs {
                        metrics::lateness(late + started.elapsed().as_secs_f64());
                    }
                    if row.retry {
                        recorded.woken.push(row.subject);
                    }
                }
                Outcome::Failed(failure) if failure.kind().is_broker_fault() => {
                    metrics::failed(failure.kind().as_str());
                    recorded.broker_faults += 1;
                    recorded
                        .first_fault
                        .get_or_insert_with(|| failure.to_string());
                    unresolved.push(row);
                }
                Outcome::Failed(failure) => recorded.failures.push(self.refusal(&row, &failure)),
                Outcome::Unresolved => unresolved.push(row),
            }
        }
        report.published = recorded.published.len();
        report.failed = recorded.failures.len();
        report.deferred = deferred.len();
        report.unresolved = unresolved.len();
        report.broker_faults = recorded.broker_faults;
        self.note_broker_health(
            report.published,
            recorded.broker_faults,
            recorded.first_fault.as_deref(),
        );
        self.record(recorded, &deferred).await?;
        Ok(unresolved)
    }

    /// Writes a batch's outcomes: marks, refusals, deferrals, and the
    /// followers made due.
    async fn record(
        &self,
        mut recorded: Recorded,
        deferred: &[(Uuid, Option<chrono::DateTime<chrono::Utc>>)],
    ) -> Result<()> {
        let started = Instant::now();
        self.store.mark_published(&recorded.published).await?;
        self.record_refusals(&recorded.failures).await?;
        self.store.defer(deferred, self.config.backoff_max).await?;
        recorded.woken.sort_unstable();
        recorded.woken.dedup();
        let woken: Vec<&str> = recorded.woken.iter().map(String::as_str).collect();
        self.store.wake_followers(&woken).await?;
        metrics::phase("mark", started.elapsed());
        Ok(())
    }

    /// How a row refused for a reason of its own (not a broker fault) is
    /// recorded: backed off (or parked at once when it can never be
    /// published as it is), counting an attempt, or, when the stream read
    /// again does not capture its type (the operator's fix is on the stream),
    /// waiting a refresh interval in the retry lane at no cost.
    pub(crate) fn refusal(&self, row: &ClaimedRow, failure: &PublishFailure) -> Failure {
        metrics::failed(failure.kind().as_str());
        if failure.kind().counts_as_attempt() {
            let attempt = u32::try_from(row.attempts).unwrap_or(0).saturating_add(1);
            Failure {
                id: row.id,
                error: failure.to_string(),
                retry_in: self.backoff.delay(attempt),
                permanent: failure.kind().is_permanent(),
                counted: true,
            }
        } else {
            Failure {
                id: row.id,
                error: failure.to_string(),
                retry_in: self.config.stream_refresh,
                permanent: false,
                counted: false,
            }
        }
    }

    /// Records refused rows ([`refusal`](Self::refusal)); one error line per
    /// row that reached the attempt cap.
    pub(crate) async fn record_refusals(&self, failures: &[Failure]) -> Result<()> {
        let capped = self
            .store
            .mark_failed(failures, self.config.max_attempts)
            .await?;
        // One line per row parked, its column values cut short (a writer may
        // put text of any length in them; the error is the relay's own, short).
        for row in &capped {
            error!(
                event_id = %row.id,
                subject = %message::for_log(&row.subject),
                event_type = %message::for_log(&row.event_type),
                attempts = row.attempts,
                last_error = row.last_error.as_deref().unwrap_or_default(),
                "outbox row parked at the attempt cap; its subject is blocked until an operator resets it"
            );
        }
        metrics::capped(capped.len());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(subject: &str, seq: i64) -> ClaimedRow {
        ClaimedRow {
            subject: subject.into(),
            seq,
            ..ClaimedRow::sample()
        }
    }

    #[test]
    fn rows_sort_into_chains_per_subject_deferrals_and_unresolved() {
        let over = ClaimedRow {
            over_budget: true,
            ..row("a", 5)
        };
        let behind = ClaimedRow {
            blocker: Some(Blocker::Parked),
            ..row("c", 3)
        };
        let due = ClaimedRow {
            blocker: Some(Blocker::DueNow),
            ..row("d", 4)
        };
        let sorted = Sorted::of(vec![
            row("a", 1),
            row("b", 2),
            behind,
            due,
            row("a", 6),
            over,
        ]);
        let chains: Vec<Vec<i64>> = sorted
            .chains
            .iter()
            .map(|c| c.iter().map(|r| r.seq).collect())
            .collect();
        assert_eq!(chains, [vec![1, 6], vec![2]]);
        assert_eq!(sorted.deferred.len(), 1);
        let unresolved: Vec<i64> = sorted.unresolved.iter().map(|r| r.seq).collect();
        assert_eq!(unresolved, [4, 5]);
    }
}
