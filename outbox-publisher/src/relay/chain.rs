//! One batch: claim from the checked-out shards, publish, record every outcome,
//! move the cursors.
//!
//! Every row read ends the batch in one of these states:
//! - **published**: acked by JetStream (a duplicate ack counts) and marked,
//!   with the ack's stream and sequence when the sink reports them;
//! - **failed**: refused for a reason of its own (recorded, backed off, or
//!   parked at once when it can never be published as it is);
//! - **deferred**: held back behind an earlier failed row of its subject and
//!   moved to the retry lane, due when that row is;
//! - **unresolved**: not tried (behind a broker fault or an unresolved row of
//!   its subject, past the byte budget, out of time). Nothing is written; the
//!   shard's cursor stops before it, so the next batch reads it again.
//!
//! A broker fault (not connected, no ack in time, no stream answering) leaves
//! the row unresolved and costs it no attempt: only a refusal of the row
//! itself counts toward its cap. A row whose type the stream, read again,
//! does not capture is failed without counting an attempt: it waits in the
//! retry lane for `stream_refresh` and is tried again, until an operator
//! adds its subject to the stream (nothing to reset on the row).
//!
//! # One entity's rows without an ack per row
//!
//! Rows of one `subject` (an entity) must be stored in the stream in `seq`
//! order, and a later one never before an earlier one is, whatever fails.
//! Sending them without waiting for each PubAck breaks that as soon as one
//! in the middle is refused (the stream at `max_bytes` with `discard: new`,
//! a per-subject limit) or lost (a reconnect, a timeout) while a later one is
//! stored: nothing can take a stored message back. So a chain is published
//! in **JetStream atomic batches** (ADR-50, nats-server 2.12+): up to
//! [`MAX_BATCH`] messages staged under one `Nats-Batch-Id` with
//! `Nats-Batch-Sequence` 1, 2, …, and committed by the last. The server
//! checks every message of the batch (limits, `Nats-Expected-Stream`,
//! `Nats-Msg-Id` dedupe) before it stores any, stores all of them
//! contiguously in order, or none; a gap in the sequence (a message lost
//! across a reconnect) abandons the batch. The commit's PubAck names the
//! batch, its count and the last message's sequence, from which each row's
//! `published_seq` follows. Consequences the relay relies on:
//!
//! - whatever the server stores of a batch is a prefix of it, in order:
//!   all of it, or nothing (every refusal it checks before storing: limits,
//!   `discard: new`, a message it already has), or, on a single server whose
//!   store fails part way through the commit, the messages before the
//!   failure. A later row is never stored without every earlier one of the
//!   batch, and one batch of a chain is in flight at a time, the next sent
//!   only after its commit's ack;
//! - a refused batch's rows are published one at a time (the ack of each
//!   awaited before the next), which finds the row the stream refuses and
//!   records it as before, with dedupe answering for any already stored; a
//!   batch holding a message the stream already has (a republish after a
//!   takeover) is refused whole, so that path takes those rows too;
//! - a broker fault (no commit ack in time, not connected) leaves it unknown
//!   how much of the prefix was stored: the rows stay unresolved at no cost
//!   to their attempts, and are sent again later (stored ones then answered
//!   by dedupe);
//! - a stream without `allow_atomic` (created before, or by hand), or a
//!   server older than 2.12 (which does not know the setting and would store
//!   the messages one by one, unanswered), is never sent a batch: the sink
//!   batches only when the stream's config as last read from the server
//!   says `allow_atomic` (see [`Sink::batch_len`]); rows then go one at a
//!   time, as they always did. The relay creates its stream with
//!   `allow_atomic` on servers that know it.
//!
//! Pre-validating each message against the stream's config and pipelining
//! plain publishes was rejected: a refusal depends on the stream's state
//! when the message arrives (bytes stored, other publishers, an edit by an
//! operator), which the relay cannot see in advance, and a message written
//! to a connection that drops is lost while later ones, queued by the
//! client, go out on the new connection.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use futures::StreamExt;
use tracing::{debug, error};
use uuid::Uuid;

use super::shards::Checkout;
use super::{BatchReport, Relay, message};
use crate::error::Result;
use crate::metrics;
use crate::sink::{MAX_BATCH, OutgoingMessage, PublishAck, PublishFailure, Sink};
use crate::store::{Blocker, ClaimRequest, ClaimedRow, Failure, Position};

/// Rows a claim may read from one shard, whatever the batch is split over.
const MIN_PER_SHARD: usize = 16;

/// Fewest rows of a subject sent as an atomic batch. The server stages a
/// batch in a store of its own before it commits it, which costs more than
/// a few acks awaited in turn; and while many subjects have rows, their
/// chains run side by side anyway (a spread backlog, mostly chains of 1 to
/// 2 rows, drained about 3 times slower with batches from 2 rows).
const MIN_BATCH: usize = 16;

/// What happened to one publishable row.
#[derive(Debug)]
pub(super) enum Outcome {
    Published {
        duplicate: bool,
        /// Where the broker stored it, if the sink said.
        position: Option<Position>,
    },
    Failed(PublishFailure),
    /// A broker fault, or not tried.
    Unresolved,
}

/// Rows a claim reads from each checked-out shard, in `had_rows`' order.
///
/// The batch is shared by the shards that had rows at their last read; the
/// others are read a few rows deep ([`MIN_PER_SHARD`]), enough to notice new
/// rows. So a backlog left in a few shards (the end of a drain, a few busy
/// entities) is still read in full batches.
fn claim_limits(had_rows: &[bool], batch_size: usize) -> Vec<i32> {
    let busy = had_rows.iter().filter(|&&b| b).count().max(1);
    let idle = batch_size.min(MIN_PER_SHARD);
    let per_busy = batch_size.div_ceil(busy).max(idle);
    had_rows
        .iter()
        .map(|&b| i32::try_from(if b { per_busy } else { idle }).unwrap_or(i32::MAX))
        .collect()
}

/// Main-lane rows read per shard, and the highest `seq` read.
fn main_lane_reads(rows: &[ClaimedRow]) -> HashMap<i16, (usize, i64)> {
    let mut read: HashMap<i16, (usize, i64)> = HashMap::new();
    for row in rows.iter().filter(|r| !r.retry) {
        let e = read.entry(row.shard).or_insert((0, 0));
        e.0 += 1;
        e.1 = e.1.max(row.seq);
    }
    read
}

/// Where each of `shards`' cursors moves after a batch: up to `settled`, not
/// past the last main-lane row read when the shard read its whole limit (it
/// may have more), never past an unresolved main-lane row (the next batch
/// reads it again).
fn cursor_moves(
    shards: &[i16],
    limits: &[i32],
    settled: i64,
    read: &HashMap<i16, (usize, i64)>,
    unresolved: &[ClaimedRow],
) -> Vec<i64> {
    let mut stop: HashMap<i16, i64> = HashMap::new();
    for row in unresolved.iter().filter(|r| !r.retry) {
        let e = stop.entry(row.shard).or_insert(i64::MAX);
        *e = (*e).min(row.seq - 1);
    }
    shards
        .iter()
        .zip(limits)
        .map(|(shard, &limit)| {
            let mut to = settled;
            let limit = usize::try_from(limit).unwrap_or(usize::MAX);
            if let Some(&(n, last)) = read.get(shard)
                && n >= limit
            {
                to = to.min(last);
            }
            if let Some(&s) = stop.get(shard) {
                to = to.min(s);
            }
            to
        })
        .collect()
}

impl<S: Sink> Relay<S> {
    /// Claims from `checkout`'s shards, publishes, marks, and advances cursors.
    pub(super) async fn run_batch(&self, checkout: &Checkout<'_>) -> Result<BatchReport> {
        // Settled before the claim's snapshot is taken: safe to move cursors
        // to, within the same epoch (read first).
        let epoch = self.horizon.epoch();
        // Beside a WAL source, the main lane stops where the WAL begins;
        // cursors never pass it, so rows above it stay readable here if the
        // WAL source hands them back (a lost slot).
        let main_until = self.main_until.load(std::sync::atomic::Ordering::Acquire);
        let settled = self.horizon.settled().min(main_until);
        let cursors = checkout.cursors(epoch);
        let limits = claim_limits(&checkout.had_rows(), self.config.batch_size);
        let max_payload = self.sink.max_payload();
        let started = Instant::now();
        let rows = self
            .store
            .claim(&ClaimRequest {
                shards: checkout.ids(),
                cursors: &cursors,
                limits: &limits,
                retry_limit: self.config.batch_size,
                max_attempts: self.config.max_attempts,
                byte_budget: self.config.batch_bytes,
                max_message: max_payload,
                main_until,
            })
            .await?;
        metrics::phase("claim", started.elapsed());
        if rows.is_empty() {
            for &shard in checkout.ids() {
                checkout.advance(shard, settled, epoch);
                checkout.set_had_rows(shard, false);
            }
            self.tick_horizon().await?;
            return Ok(BatchReport::default());
        }
        metrics::batch(rows.len());
        let claimed_at = Instant::now();
        let deadline = claimed_at
            + self
                .config
                .lease
                .saturating_sub(self.config.publish_timeout);
        let mut report = BatchReport {
            claimed: rows.len(),
            ..BatchReport::default()
        };
        let read = main_lane_reads(&rows);
        let unresolved = self
            .publish_rows(rows, deadline, max_payload, &mut report, None)
            .await?;
        let moves = cursor_moves(checkout.ids(), &limits, settled, &read, &unresolved);
        for (&shard, to) in checkout.ids().iter().zip(moves) {
            checkout.set_had_rows(shard, read.contains_key(&shard));
            checkout.advance(shard, to, epoch);
        }
        self.tick_horizon().await?;
        debug!(?report, settled, cursors = ?cursors.iter().take(3).collect::<Vec<_>>(), took = ?claimed_at.elapsed(), "batch done");
        Ok(report)
    }

    /// Publishes `rows` (in seq order) and records every outcome: rows
    /// blocked by an earlier row of their subject in the retry lane are
    /// deferred behind it, the others published per subject in order
    /// ([`publish_chain`](Self::publish_chain)), subjects side by side;
    /// published rows are marked, refused ones recorded (backed off or
    /// parked), followers of rows published out of the retry lane made due.
    /// Returns the rows left unresolved (past the byte budget, behind a
    /// broker fault or an unresolved row of their subject, out of time),
    /// with nothing written for them; `report` gets the counts. With
    /// `marks`, the published rows are not marked here but added to it, for
    /// the caller to mark off the publish path.
    pub(super) async fn publish_rows(
        &self,
        rows: Vec<ClaimedRow>,
        deadline: Instant,
        max_payload: usize,
        report: &mut BatchReport,
        marks: Option<&mut Vec<(Uuid, Option<Position>)>>,
    ) -> Result<Vec<ClaimedRow>> {
        let mut deferred: Vec<(Uuid, Option<chrono::DateTime<chrono::Utc>>)> = Vec::new();
        let mut unresolved: Vec<ClaimedRow> = Vec::new();
        let mut chains: Vec<Vec<ClaimedRow>> = Vec::new();
        let mut chain_of: HashMap<String, usize> = HashMap::new();
        for row in rows {
            if row.over_budget {
                unresolved.push(row);
                continue;
            }
            match row.blocker {
                Some(Blocker::Parked) => deferred.push((row.id, None)),
                Some(Blocker::Until(t)) => deferred.push((row.id, Some(t))),
                Some(Blocker::DueNow) => unresolved.push(row),
                None => {
                    let i = *chain_of.entry(row.subject.clone()).or_insert_with(|| {
                        chains.push(Vec::new());
                        chains.len() - 1
                    });
                    chains[i].push(row);
                }
            }
        }

        let started = Instant::now();
        let results: Vec<Vec<(ClaimedRow, Outcome)>> = futures::stream::iter(chains)
            .map(|chain| self.publish_chain(chain, deadline, max_payload))
            .buffer_unordered(self.config.max_in_flight)
            .collect()
            .await;
        metrics::phase("publish", started.elapsed());

        let mut published: Vec<(Uuid, Option<Position>)> = Vec::new();
        let mut woken: Vec<String> = Vec::new();
        let mut failures: Vec<Failure> = Vec::new();
        let mut broker_faults = 0;
        let mut first_fault: Option<String> = None;
        for (row, outcome) in results.into_iter().flatten() {
            match outcome {
                Outcome::Published {
                    duplicate,
                    position,
                } => {
                    published.push((row.id, position));
                    report.duplicates += usize::from(duplicate);
                    if row.retry {
                        woken.push(row.subject);
                    }
                }
                Outcome::Failed(failure) if failure.kind().is_broker_fault() => {
                    metrics::failed(failure.kind().as_str());
                    broker_faults += 1;
                    first_fault.get_or_insert_with(|| failure.to_string());
                    unresolved.push(row);
                }
                Outcome::Failed(failure) => failures.push(self.refusal(&row, &failure)),
                Outcome::Unresolved => unresolved.push(row),
            }
        }
        report.published = published.len();
        report.failed = failures.len();
        report.deferred = deferred.len();
        report.unresolved = unresolved.len();
        report.broker_faults = broker_faults;
        self.note_broker_health(report.published, broker_faults, first_fault.as_deref());

        let started = Instant::now();
        match marks {
            Some(marks) => marks.extend(published),
            None => {
                self.store.mark_published(&published).await?;
            }
        }
        self.record_refusals(&failures).await?;
        self.store.defer(&deferred, self.config.backoff_max).await?;
        woken.sort_unstable();
        woken.dedup();
        let woken: Vec<&str> = woken.iter().map(String::as_str).collect();
        self.store.wake_followers(&woken).await?;
        metrics::phase("mark", started.elapsed());
        Ok(unresolved)
    }

    /// How a row refused for a reason of its own (not a broker fault) is
    /// recorded: backed off (or parked at once when it can never be
    /// published as it is), counting an attempt, or, when the stream read
    /// again does not capture its type (the operator's fix is on the stream),
    /// waiting a refresh interval in the retry lane at no cost.
    pub(super) fn refusal(&self, row: &ClaimedRow, failure: &PublishFailure) -> Failure {
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
    pub(super) async fn record_refusals(&self, failures: &[Failure]) -> Result<()> {
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

    /// Moves the settled horizon on for the next batch, off the path from a
    /// wake-up to its claim.
    async fn tick_horizon(&self) -> Result<()> {
        let started = Instant::now();
        self.horizon.tick(&self.store).await?;
        metrics::phase("horizon", started.elapsed());
        Ok(())
    }

    /// Publishes one subject's rows in order; the first row not published
    /// stops the rest (they stay unresolved).
    ///
    /// Rows go out in atomic batches while the sink takes them (see the
    /// module docs: all stored in order, or none), else one at a time, each
    /// ack awaited before the next row is sent. A batch refused by the
    /// stream stored at most a prefix of itself: its rows are then published
    /// one at a time, which finds the row refused (and lets dedupe answer for
    /// rows already stored), and batching resumes after them. A broker fault during a
    /// batch leaves all of its rows and the rest unresolved.
    pub(super) async fn publish_chain(
        &self,
        chain: Vec<ClaimedRow>,
        deadline: Instant,
        max_payload: usize,
    ) -> Vec<(ClaimedRow, Outcome)> {
        let mut out = Vec::with_capacity(chain.len());
        let mut tally = metrics::Published::new();
        let mut pending: VecDeque<ClaimedRow> = chain.into();
        // Rows to publish one at a time before a batch is tried again.
        let mut singly = 0usize;
        while Instant::now() < deadline {
            let Some(row) = pending.front() else {
                break;
            };
            let first = message::to_message(row, max_payload);
            let batches = singly == 0
                && pending.len() >= MIN_BATCH
                && first
                    .as_ref()
                    .is_ok_and(|m| self.sink.batch_len(std::slice::from_ref(m)) == 1);
            if batches {
                // The longest prefix that makes messages, as far as the sink
                // would batch it.
                let (mut messages, n) = self.batchable(&pending, max_payload);
                if n >= MIN_BATCH {
                    messages.truncate(n);
                    match self
                        .publish_batch(&mut pending, messages, &mut out, &mut tally)
                        .await
                    {
                        Ok(()) => continue,
                        Err(BatchStop::Refused) => singly = n,
                        Err(BatchStop::Fault) => break,
                    }
                } else {
                    singly = n.max(1);
                }
            }
            let Some(row) = pending.pop_front() else {
                break;
            };
            singly = singly.saturating_sub(1);
            let started = Instant::now();
            let result = match first {
                Ok(m) => self.sink.publish(m).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(ack) => out.push(published(row, &ack, started, &mut tally)),
                Err(failure) => {
                    debug!(event_id = %row.id, subject = %message::for_log(&row.subject), error = %failure, "publish failed");
                    out.push((row, Outcome::Failed(failure)));
                    break;
                }
            }
        }
        out.extend(pending.into_iter().map(|row| (row, Outcome::Unresolved)));
        self.tally.count(&out);
        out
    }

    /// The messages of the longest prefix of `pending` (at most
    /// [`MAX_BATCH`] rows) that make messages, and how many of them the sink
    /// would batch now.
    fn batchable(
        &self,
        pending: &VecDeque<ClaimedRow>,
        max_payload: usize,
    ) -> (Vec<OutgoingMessage>, usize) {
        let messages: Vec<OutgoingMessage> = pending
            .iter()
            .take(MAX_BATCH)
            .map_while(|row| message::to_message(row, max_payload).ok())
            .collect();
        let n = self.sink.batch_len(&messages);
        (messages, n)
    }

    /// Publishes the first `messages.len()` rows of `pending` as one atomic
    /// batch; on success moves them to `out` as published. On a broker
    /// fault the first row is recorded with the fault (the rest stay in
    /// `pending`, unresolved); on a refusal nothing is recorded.
    async fn publish_batch(
        &self,
        pending: &mut VecDeque<ClaimedRow>,
        messages: Vec<OutgoingMessage>,
        out: &mut Vec<(ClaimedRow, Outcome)>,
        tally: &mut metrics::Published,
    ) -> Result<(), BatchStop> {
        let n = messages.len();
        let started = Instant::now();
        match self.sink.publish_batch(messages).await {
            Ok(acks) if acks.len() == n => {
                for ack in acks {
                    if let Some(row) = pending.pop_front() {
                        out.push(published(row, &ack, started, tally));
                    }
                }
                Ok(())
            }
            Ok(acks) => {
                // A sink that broke its contract: what it stored is found
                // out by the next batch, through dedupe.
                error!(
                    sent = n,
                    acks = acks.len(),
                    "the sink acked a batch with another number of acks; leaving its rows unresolved"
                );
                Err(BatchStop::Fault)
            }
            Err(failure) if failure.kind().is_broker_fault() => {
                if let Some(row) = pending.pop_front() {
                    debug!(event_id = %row.id, subject = %message::for_log(&row.subject), rows = n, error = %failure, "batch publish failed");
                    out.push((row, Outcome::Failed(failure)));
                }
                Err(BatchStop::Fault)
            }
            Err(failure) => {
                debug!(rows = n, error = %failure, "batch refused; publishing its rows one at a time");
                Err(BatchStop::Refused)
            }
        }
    }
}

/// Why a chain's batch did not publish its rows.
#[derive(Debug)]
enum BatchStop {
    /// Answered with a refusal: at most a prefix stored, in order.
    Refused,
    /// A broker fault, or not known what was stored: stop the chain.
    Fault,
}

/// A published row with its metrics recorded.
fn published(
    row: ClaimedRow,
    ack: &PublishAck,
    started: Instant,
    tally: &mut metrics::Published,
) -> (ClaimedRow, Outcome) {
    let duplicate = ack.duplicate;
    let position = ack.position().map(|(stream, sequence)| Position {
        stream: stream.to_owned(),
        sequence,
    });
    let since_commit = row
        .created_at
        .and_then(|t| (chrono::Utc::now() - t).to_std().ok())
        .unwrap_or_default();
    tally.record(&row.event_type, duplicate, started.elapsed(), since_commit);
    (
        row,
        Outcome::Published {
            duplicate,
            position,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(shard: i16, seq: i64, retry: bool) -> ClaimedRow {
        ClaimedRow {
            shard,
            seq,
            retry,
            ..ClaimedRow::sample()
        }
    }

    #[test]
    fn the_batch_is_shared_by_the_shards_that_had_rows() {
        // Two busy shards share 100; the idle ones look 16 rows deep.
        assert_eq!(
            claim_limits(&[true, false, true, false], 100),
            [50, 16, 50, 16]
        );
        // None busy: each looks 16 rows deep.
        assert_eq!(claim_limits(&[false, false], 100), [16, 16]);
        // A busy shard never reads fewer than an idle one.
        assert_eq!(claim_limits(&[true; 10], 100), [16; 10]);
        // A batch smaller than the idle depth bounds both.
        assert_eq!(claim_limits(&[true, false], 8), [8, 8]);
    }

    #[test]
    fn cursors_stop_at_the_settled_horizon_a_full_read_and_an_unresolved_row() {
        let rows = [
            row(1, 10, false),
            row(1, 12, false),
            row(2, 20, false),
            row(2, 25, false),
            row(3, 5, true), // the retry lane moves no cursor
        ];
        let read = main_lane_reads(&rows);
        assert_eq!(read[&1], (2, 12));
        assert_eq!(read[&2], (2, 25));
        assert!(!read.contains_key(&3));
        let shards = [1, 2, 3, 4];
        // Shard 1 read its whole limit (2): it may have more past seq 12.
        // Shard 2 read less than its limit, but seq 20 is unresolved.
        // Shards 3 and 4 go to the settled horizon.
        let limits = [2, 16, 16, 16];
        let unresolved = [row(2, 20, false), row(3, 4, true)];
        assert_eq!(
            cursor_moves(&shards, &limits, 100, &read, &unresolved),
            [12, 19, 100, 100]
        );
        // Nothing unresolved and nothing full: all to the horizon.
        assert_eq!(
            cursor_moves(&shards, &[16; 4], 30, &read, &[]),
            [30, 30, 30, 30]
        );
    }
}
