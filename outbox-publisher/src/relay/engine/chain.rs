//! The engine's publish step for one subject: a chain of its rows, in `seq`
//! order, each row validated into a message ([`message`]) and sent as an
//! atomic batch or one at a time, the first row not published stopping the
//! rest. Both sources publish through it.
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

use std::collections::VecDeque;
use std::time::Instant;

use tracing::{debug, error};

use super::Engine;
use crate::metrics;
use crate::relay::message;
use crate::sink::{MAX_BATCH, OutgoingMessage, PublishAck, PublishFailure, Sink};
use crate::store::{ClaimedRow, Position};

/// Fewest rows of a subject sent as an atomic batch. The server stages a
/// batch in a store of its own before it commits it, which costs more than
/// a few acks awaited in turn; and while many subjects have rows, their
/// chains run side by side anyway (a spread backlog, mostly chains of 1 to
/// 2 rows, drained about 3 times slower with batches from 2 rows).
const MIN_BATCH: usize = 16;

/// What happened to one publishable row.
#[derive(Debug)]
pub(crate) enum Outcome {
    Published {
        duplicate: bool,
        /// Where the broker stored it, if the sink said.
        position: Option<Position>,
    },
    Failed(PublishFailure),
    /// A broker fault, or not tried.
    Unresolved,
}

impl<S: Sink> Engine<S> {
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
    pub(crate) async fn publish_chain(
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
    // A scheduled row's wait for its due time is no part of commit → ack
    // (its lateness is a histogram of its own).
    let since_commit = row
        .created_at
        .filter(|_| row.due_at.is_none())
        .and_then(|t| (chrono::Utc::now() - t).to_std().ok());
    tally.record(&row.event_type, duplicate, started.elapsed(), since_commit);
    (
        row,
        Outcome::Published {
            duplicate,
            position,
        },
    )
}
