//! The settled-seq horizon: the highest `seq` below which no transaction can
//! still commit a row.
//!
//! A shard's cursor may only pass seqs that are settled, or a transaction that
//! took its seq early and commits late would land behind the cursor and never
//! be read (the watermark trap). The migration's trigger takes the writer's
//! transaction id *before* its seq. So if `last_seq` is read, and afterwards a
//! snapshot `S` is taken, every transaction holding a seq ≤ `last_seq` either
//! had committed before `S` or is listed in `S`'s running transactions. Once
//! all of those are seen finished by a later snapshot, `last_seq` is settled:
//! every row up to it is committed (and visible to any later statement) or
//! will never exist.
//!
//! One statement per tick (`queries/horizon.sql`) reads the sequence, takes a
//! snapshot, and checks whether the previous candidate's running transactions
//! have finished. Because a statement's snapshot is taken before it reads the
//! sequence, the seq read by tick *k* is paired with the snapshot of tick
//! *k + 1*, and settles at tick *k + 2* at the earliest. A writer transaction
//! that stays open holds the horizon back until it ends; rows keep flowing
//! (claims do not wait for the horizon), only the cursors stop, and claims
//! re-read the rows published since (their dead index entries) meanwhile.
//!
//! **The sequence going back.** PostgreSQL hands out again, after a crash,
//! sequence values that only uncommitted transactions had taken, when the
//! WAL record reserving them was not flushed before the crash; an operator's
//! `setval` can do the same. Rows written with those seqs would land behind
//! the cursors. A tick that reads a `last_seq` lower than the one before
//! therefore starts a new *epoch*: the settled horizon drops to 0, and every
//! shard's cursor goes back to its start at its next read
//! ([`Horizon::epoch`]); cursor moves computed in the old epoch are dropped.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use crate::error::Result;
use crate::store::Store;

/// Ticks closer together than this reuse the last result.
const MIN_TICK_INTERVAL: Duration = Duration::from_millis(5);

#[derive(Debug, Default)]
struct State {
    last_tick: Option<Instant>,
    /// `last_seq` of the latest tick: a lower one means the sequence went back.
    last_read: Option<i64>,
    /// `last_seq` read by the previous tick: not yet paired with a snapshot.
    unpaired: Option<i64>,
    /// A seq and a snapshot taken after it was read, waiting to settle.
    candidate: Option<(i64, String)>,
}

#[derive(Debug, Default)]
pub(crate) struct Horizon {
    state: Mutex<State>,
    settled: AtomicI64,
    /// Bumped when the sequence went back; cursors of an older epoch are void.
    epoch: AtomicU64,
}

impl Horizon {
    /// The settled seq as of the last completed tick. Every row with a seq at
    /// or below it that will ever be visible is visible to statements that
    /// start after this returns.
    pub(crate) fn settled(&self) -> i64 {
        self.settled.load(Ordering::Acquire)
    }

    /// The current epoch. Read it before [`settled`](Self::settled): a
    /// settled value read after it belongs to that epoch or a later one.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Runs a tick if one is due (and no other worker is running one).
    /// Workers tick after a batch, so a wake-up goes straight to its claim.
    pub(crate) async fn tick(&self, store: &Store) -> Result<()> {
        // Another worker ticking: its result is not needed to stay safe, only
        // to move on; use the value settled so far.
        if let Ok(mut state) = self.state.try_lock()
            && state
                .last_tick
                .is_none_or(|t| t.elapsed() >= MIN_TICK_INTERVAL)
        {
            let checking = state.candidate.as_ref().map(|c| c.1.clone());
            let tick = store.tick(checking.as_deref()).await?;
            state.last_tick = Some(Instant::now());
            if state.last_read.is_some_and(|read| tick.last_seq < read) {
                tracing::warn!(
                    before = state.last_read,
                    now = tick.last_seq,
                    "the seq sequence went back (a database crash, or setval): every shard is read from its start again",
                );
                self.settled.store(0, Ordering::Release);
                self.epoch.fetch_add(1, Ordering::AcqRel);
                state.candidate = None;
                state.unpaired = None;
            }
            state.last_read = Some(tick.last_seq);
            if checking.is_some()
                && tick.settled
                && let Some((seq, _)) = state.candidate.take()
            {
                self.settled.fetch_max(seq, Ordering::AcqRel);
            }
            if state.candidate.is_none()
                && let Some(seq) = state.unpaired
            {
                state.candidate = Some((seq, tick.snapshot));
            }
            state.unpaired = Some(tick.last_seq);
        }
        Ok(())
    }
}
