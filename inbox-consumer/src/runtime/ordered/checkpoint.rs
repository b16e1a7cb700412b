//! The takeover checkpoint of an ordered consumer's leader: a stream sequence
//! at or below which every message the consumer has to handle is finished,
//! except a short list of sequences. The next leader's
//! [`scan`](super::takeover::scan) starts there instead of at the ack floor,
//! so one message left unacked for hours does not make it read everything
//! handled since.
//!
//! # How a leader knows
//!
//! The takeover scan hands the new leader what it classified: every message
//! up to the consumer's last delivered stream sequence at the time (`C0`) is
//! finished or listed as unfinished, and no delivery happened meanwhile (the
//! previous leader's pulls had expired, the new one had not pulled), so the
//! consumer's delivery sequence then (`D0`) is known too. From then on the
//! leader counts every message it receives:
//!
//! - JetStream numbers each delivery of a consumer, redeliveries included,
//!   one more than the last (the consumer sequence), and delivers each
//!   message the first time in stream order. So while the leader has
//!   received every delivery from `D0 + 1` on, with no gap, every message of
//!   the consumer's subjects up to the highest stream sequence among them
//!   (the *frontier*) has reached it: one below `C0` was classified by the
//!   scan, one above was delivered first after `D0`, before the message at
//!   the frontier.
//! - Each message it receives is *open* until its task ends with it
//!   finished (committed and acked, dead-lettered and terminated, acked
//!   unhandled as unrouted or as a replay for another consumer). One nak'ed
//!   for the next leader, or left in an in-place retry, stays open.
//! - The checkpoint is the frontier and the open sequences at or below it.
//!   Both only ever claim what stays true (a finished message stays
//!   finished), so an older checkpoint, or a deposed leader's, is still
//!   right, only further back.
//!
//! A gap in the delivery sequence (a delivery lost on the way, or taken by
//! a frozen predecessor's late pull) freezes the frontier, and so does a
//! takeover whose scan hit its bound (the messages after where it stopped
//! are not known); each is logged. A frozen leader records its last sound
//! checkpoint, and [`catch_up`](super::takeover::catch_up)s in the
//! background, within the takeover scan's bounds: it reads the consumer's
//! delivery and stream sequences at that moment (`D1`, `C1`), classifies
//! the stream from the frontier to `C1` against the inbox, and then moves
//! the frontier to `C1`, or beyond along the deliveries received since
//! `D1` with no gap (it notes every delivery while frozen, at most
//! [`MAX_NOTED`]). A catch-up that hit its bound moves the frontier as far
//! as it read, and the next one goes on from there. Messages found
//! unfinished are listed unless the leader finished them meanwhile.
//! The list is capped at [`MAX_LISTED`]: past that, the checkpoint is put
//! just below the first sequence left out.
//!
//! The leader records the checkpoint every [`SAVE_EVERY`] (when it changed),
//! fenced by its epoch, and once more when it lets go at shutdown.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use sqlx::PgPool;

use crate::error::Error;

/// The most stream sequences a checkpoint lists.
pub(crate) const MAX_LISTED: usize = 1_024;

/// How often a leader records its checkpoint.
pub(crate) const SAVE_EVERY: Duration = Duration::from_secs(1);

/// The most deliveries a frozen leader notes for its catch-up.
pub(crate) const MAX_NOTED: usize = 100_000;

/// How long a frozen leader waits before it catches up, and between tries.
pub(crate) const CATCH_UP_EVERY: Duration = Duration::from_secs(5);

/// How long recording a checkpoint may take before it is given up (the next
/// one is tried at the next tick).
pub(crate) const SAVE_TIMEOUT: Duration = Duration::from_secs(5);

/// A checkpoint: the stream sequence, and the unfinished sequences at or below it.
pub(crate) type Position = (u64, Vec<u64>);

/// What a leader knows about the stream so far. See the [module docs](self).
#[derive(Debug)]
pub(crate) struct Checkpoint {
    /// Every message at or below is finished, unless open.
    frontier: u64,
    /// The next delivery sequence expected; `None` once frozen.
    next_delivery: Option<u64>,
    /// Stream sequences received (or left by the scan) and not finished.
    open: BTreeSet<u64>,
    /// What was last recorded, not to write it again.
    recorded: Option<Position>,
    /// While frozen: the deliveries received (delivery sequence → stream
    /// sequence), for the catch-up.
    noted: BTreeMap<u64, u64>,
    /// While a catch-up runs: the messages finished meanwhile.
    finished_meanwhile: Option<HashSet<u64>>,
}

impl Checkpoint {
    /// Everything up to `frontier` is finished except `open`; the next
    /// delivery is `next_delivery` (`None`: the frontier cannot move).
    pub(crate) fn new(
        frontier: u64,
        next_delivery: Option<u64>,
        open: impl IntoIterator<Item = u64>,
    ) -> Self {
        Self {
            frontier,
            next_delivery,
            open: open.into_iter().collect(),
            recorded: None,
            noted: BTreeMap::new(),
            finished_meanwhile: None,
        }
    }

    /// A message was received: stream sequence `stream`, delivery sequence
    /// `delivery`.
    pub(crate) fn received(&mut self, consumer: &str, stream: u64, delivery: u64) {
        self.open.insert(stream);
        let Some(next) = self.next_delivery else {
            self.note(delivery, stream);
            return;
        };
        if delivery == next {
            self.next_delivery = Some(next.saturating_add(1));
            self.frontier = self.frontier.max(stream);
        } else if delivery > next {
            tracing::warn!(
                consumer,
                expected = next,
                received = delivery,
                checkpoint = self.frontier,
                "deliveries of the consumer did not reach this leader (lost, or taken by another \
                 puller): the takeover checkpoint stays where it is for this tenure",
            );
            self.next_delivery = None;
            self.note(delivery, stream);
        }
    }

    /// Notes a delivery received while frozen.
    fn note(&mut self, delivery: u64, stream: u64) {
        self.noted.insert(delivery, stream);
        if self.noted.len() > MAX_NOTED {
            self.noted.pop_first();
        }
    }

    /// The message at stream sequence `stream` is finished.
    pub(crate) fn finished(&mut self, stream: u64) {
        self.open.remove(&stream);
        if let Some(meanwhile) = &mut self.finished_meanwhile {
            meanwhile.insert(stream);
        }
    }

    /// Where a catch-up should start: the frontier, while frozen and no
    /// catch-up runs.
    pub(crate) fn needs_catch_up(&self) -> Option<u64> {
        let frozen = self.next_delivery.is_none() && self.finished_meanwhile.is_none();
        frozen.then_some(self.frontier)
    }

    /// A catch-up starts.
    pub(crate) fn catching_up(&mut self) {
        self.finished_meanwhile = Some(HashSet::new());
    }

    /// A catch-up failed: the frontier stays.
    pub(crate) fn catch_up_failed(&mut self) {
        self.finished_meanwhile = None;
    }

    /// A catch-up ended with `caught`: moves the frontier (see the
    /// [module docs](self)).
    pub(crate) fn caught_up(&mut self, consumer: &str, caught: CaughtUp) {
        let finished = self.finished_meanwhile.take().unwrap_or_default();
        self.open.extend(
            caught
                .unfinished
                .iter()
                .filter(|s| !finished.contains(s))
                .copied(),
        );
        self.frontier = self.frontier.max(caught.classified_to);
        self.noted = self.noted.split_off(&caught.next_delivery);
        if caught.classified_to < caught.delivered {
            tracing::info!(
                consumer,
                checkpoint = self.frontier,
                delivered = caught.delivered,
                "takeover checkpoint: catching up, the rest next time",
            );
            return;
        }
        let mut next = caught.next_delivery;
        while let Some(stream) = self.noted.remove(&next) {
            self.frontier = self.frontier.max(stream);
            next = next.saturating_add(1);
        }
        if self.noted.is_empty() {
            tracing::info!(
                consumer,
                checkpoint = self.frontier,
                "takeover checkpoint: caught up"
            );
            self.next_delivery = Some(next);
        }
    }

    /// The runtime gave up waiting for these messages (see
    /// [`Backlog::expire`](super::takeover::Backlog::expire)): the next
    /// leader need not wait for them either.
    pub(crate) fn given_up(&mut self, streams: &[u64]) {
        for stream in streams {
            self.open.remove(stream);
        }
    }

    /// The checkpoint to record: a stream sequence and the unfinished ones
    /// at or below it (at most [`MAX_LISTED`]).
    pub(crate) fn current(&self) -> Position {
        let mut listed = self.open.range(..=self.frontier);
        let pending: Vec<u64> = listed.by_ref().take(MAX_LISTED).copied().collect();
        match listed.next() {
            // Everything below the first one left out is still described.
            Some(first_left_out) => (first_left_out.saturating_sub(1), pending),
            None => (self.frontier, pending),
        }
    }

    /// The checkpoint to record if it changed since [`Checkpoint::recorded`].
    pub(crate) fn to_record(&self) -> Option<Position> {
        let current = self.current();
        (self.recorded.as_ref() != Some(&current)).then_some(current)
    }

    /// `checkpoint` was recorded.
    pub(crate) fn recorded(&mut self, checkpoint: Position) {
        self.recorded = Some(checkpoint);
    }
}

/// A checkpoint read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Saved {
    pub(crate) sequence: u64,
    pub(crate) pending: Vec<u64>,
}

/// The checkpoint last recorded for `consumer`, if any (and if it makes
/// sense: a row any SQL client may have written is checked, and one that
/// does not hold is ignored, with a warning).
///
/// # Errors
/// [`ErrorKind::Database`](crate::ErrorKind::Database) if it cannot be read.
pub(crate) async fn load(pool: &PgPool, consumer: &str) -> Result<Option<Saved>, Error> {
    let row = sqlx::query_file!("queries/lease_checkpoint.sql", consumer)
        .fetch_optional(pool)
        .await
        .map_err(|e| Error::database("reading the takeover checkpoint", e))?;
    let Some(row) = row else {
        return Ok(None);
    };
    let Some(sequence) = row.checkpoint_seq else {
        return Ok(None);
    };
    let sequence = u64::try_from(sequence).ok();
    let pending: Option<Vec<u64>> = row
        .checkpoint_pending
        .iter()
        .map(|s| u64::try_from(*s).ok())
        .collect();
    match (sequence, pending) {
        (Some(sequence), Some(pending)) if pending.len() <= MAX_LISTED => {
            Ok(Some(Saved { sequence, pending }))
        }
        _ => {
            tracing::warn!(
                consumer,
                listed = row.checkpoint_pending.len(),
                "the takeover checkpoint is not one a leader records (negative, or listing more \
                 than {MAX_LISTED}): ignored, scanning from the ack floor",
            );
            Ok(None)
        }
    }
}

/// Records `checkpoint` for `consumer` while `epoch` leads.
///
/// # Errors
/// [`ErrorKind::Database`](crate::ErrorKind::Database) if it cannot be
/// written.
pub(crate) async fn save(
    pool: &PgPool,
    consumer: &str,
    epoch: i64,
    (sequence, pending): Position,
) -> Result<(), Error> {
    let to_i64 = |s: u64| i64::try_from(s).unwrap_or(i64::MAX);
    let pending: Vec<i64> = pending.into_iter().map(to_i64).collect();
    sqlx::query_file!(
        "queries/lease_checkpoint_save.sql",
        consumer,
        epoch,
        to_i64(sequence),
        &pending,
    )
    .execute(pool)
    .await
    .map_err(|e| Error::database("recording the takeover checkpoint", e))?;
    Ok(())
}

/// What a leader's [`catch_up`](super::takeover::catch_up) found.
#[derive(Debug)]
pub(crate) struct CaughtUp {
    /// The consumer's next delivery sequence when it started.
    pub(crate) next_delivery: u64,
    /// The last delivered stream sequence when it started.
    pub(crate) delivered: u64,
    /// Classified up to here (`delivered`, unless a bound was hit).
    pub(crate) classified_to: u64,
    /// The unfinished messages found, by stream sequence.
    pub(crate) unfinished: Vec<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_frontier_follows_contiguous_deliveries_and_lists_what_is_open() {
        // The scan classified up to 100 and left 7 unfinished; delivery 50 was the last.
        let mut c = Checkpoint::new(100, Some(51), [7]);
        assert_eq!(c.current(), (100, vec![7]));
        c.received("c", 101, 51);
        c.received("c", 103, 52);
        // A redelivery of the scan's unfinished event.
        c.received("c", 7, 53);
        assert_eq!(c.current(), (103, vec![7, 101, 103]));
        c.finished(101);
        c.finished(7);
        assert_eq!(c.current(), (103, vec![103]));
        c.finished(103);
        assert_eq!(c.current(), (103, vec![]));
    }

    #[test]
    fn a_gap_in_the_delivery_sequence_freezes_the_frontier() {
        let mut c = Checkpoint::new(10, Some(5), []);
        c.received("c", 11, 5);
        c.received("c", 13, 7);
        c.received("c", 14, 8);
        assert_eq!(c.current(), (11, vec![11]), "13 and 14 are past the gap");
        c.finished(11);
        c.finished(13);
        assert_eq!(c.current(), (11, vec![]));
    }

    #[test]
    fn a_bounded_scan_starts_frozen_and_what_was_given_up_is_not_listed() {
        let mut c = Checkpoint::new(40, None, [3, 9]);
        c.received("c", 60, 1);
        c.given_up(&[9]);
        assert_eq!(c.current(), (40, vec![3]));
    }

    #[test]
    fn a_long_list_puts_the_checkpoint_below_the_first_sequence_left_out() {
        let open = (1..=2 * MAX_LISTED as u64).map(|s| s * 2);
        let c = Checkpoint::new(10_000, None, open);
        let (sequence, pending) = c.current();
        assert_eq!(pending.len(), MAX_LISTED);
        assert_eq!(pending.last(), Some(&(MAX_LISTED as u64 * 2)));
        assert_eq!(sequence, (MAX_LISTED as u64 + 1) * 2 - 1);
    }

    #[test]
    fn a_catch_up_moves_a_frozen_frontier_along_the_deliveries_since() {
        // Frozen at 40 (a bounded takeover scan); 7 unfinished below.
        let mut c = Checkpoint::new(40, None, [7]);
        c.received("c", 90, 10);
        assert_eq!(c.needs_catch_up(), Some(40));
        c.catching_up();
        assert_eq!(c.needs_catch_up(), None, "one at a time");
        // Meanwhile: 90 finishes; deliveries 12 and 13 arrive.
        c.finished(90);
        c.received("c", 101, 12);
        c.received("c", 102, 13);
        // The catch-up read delivery 11 / stream 100 as the last, found 55
        // and 90 unfinished (90 has finished since).
        c.caught_up(
            "c",
            CaughtUp {
                next_delivery: 12,
                delivered: 100,
                classified_to: 100,
                unfinished: vec![55, 90],
            },
        );
        assert_eq!(c.needs_catch_up(), None, "no longer frozen");
        assert_eq!(c.current(), (102, vec![7, 55, 101, 102]));
        c.received("c", 103, 14);
        assert_eq!(c.current().0, 103);
    }

    #[test]
    fn a_bounded_catch_up_moves_the_frontier_as_far_as_it_read() {
        let mut c = Checkpoint::new(40, None, []);
        c.catching_up();
        c.received("c", 300, 50);
        let caught = CaughtUp {
            next_delivery: 50,
            delivered: 200,
            classified_to: 120,
            unfinished: vec![111],
        };
        c.caught_up("c", caught);
        assert_eq!(c.current(), (120, vec![111]));
        assert_eq!(
            c.needs_catch_up(),
            Some(120),
            "still frozen: the next one goes on"
        );
        // A gap after the catch-up's snapshot keeps it frozen too.
        c.catching_up();
        c.received("c", 302, 53);
        let caught = CaughtUp {
            next_delivery: 51,
            delivered: 300,
            classified_to: 300,
            unfinished: vec![],
        };
        c.caught_up("c", caught);
        assert_eq!(c.current().0, 300);
        assert_eq!(c.needs_catch_up(), Some(300));
    }

    #[test]
    fn an_unchanged_checkpoint_is_not_recorded_again() {
        let mut c = Checkpoint::new(5, Some(1), []);
        let first = c.to_record().unwrap();
        c.recorded(first);
        assert_eq!(c.to_record(), None);
        c.received("c", 6, 1);
        assert_eq!(c.to_record(), Some((6, vec![6])));
    }
}
