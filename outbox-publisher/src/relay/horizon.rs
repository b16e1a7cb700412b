//! The settled-seq horizon: the highest `seq` below which no transaction can
//! still commit a row.
//!
//! A shard's cursor may only pass seqs that are settled, or a transaction that
//! took its seq early and commits late would land behind the cursor and never
//! be read (the watermark trap).
//!
//! **Writers.** A transaction takes a seq in the insert trigger, so it holds
//! a lock on `outbox_events` that a write takes (RowExclusiveLock) from
//! before its seq until it ends. So if `last_seq` is read and afterwards the
//! lock table is read, every transaction holding a seq ≤ `last_seq` has
//! either ended or is among the *writers* found there: transactions with an
//! id that hold such a lock. Once all of those have ended, `last_seq` is
//! settled: every row up to it is committed (and visible to any later
//! statement) or will never exist. A transaction that inserts later takes a
//! higher seq.
//!
//! Transactions that write nothing to the outbox hold nothing back: a long
//! report, a batch job on other tables, a transaction in another database of
//! the cluster, a prepared transaction that wrote elsewhere. (A snapshot's
//! list of running transactions would not do: it lists them all, and it
//! leaves out those that took their id after the newest one to end, a writer
//! among them.)
//!
//! One statement per tick (`queries/horizon.sql`) reads the sequence, the
//! writers, and whether the previous candidate's writers have ended. The
//! statement may read the locks before the sequence, so the seq read by tick
//! *k* is paired with the writers of tick *k + 1*, and settles at tick
//! *k + 2* at the earliest. A writer that stays open holds the horizon back
//! until it ends; rows keep flowing (claims do not wait for the horizon), only
//! the cursors stop, and claims re-read the rows published since (their dead
//! index entries) meanwhile. After [`NAME_AFTER`] the relay logs who holds it
//! (pid, application, client, state, age, or a prepared transaction's gid),
//! and `outbox_relay_horizon_held_seconds` says for how long, so an operator
//! can act.
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

/// Ticks closer together than this reuse the last result. A tick reads the
/// lock table, which costs the database more than a claim; only the cursors
/// wait for it (claims do not), and a cursor 50 ms behind re-reads the
/// entries of the rows published in those 50 ms, a few per shard.
const MIN_TICK_INTERVAL: Duration = Duration::from_millis(50);
/// How long a candidate waits before the relay names who holds it (and
/// again every as long while it waits).
const NAME_AFTER: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
struct State {
    last_tick: Option<Instant>,
    /// `last_seq` of the latest tick: a lower one means the sequence went back.
    last_read: Option<i64>,
    /// `last_seq` read by the previous tick: not yet paired with a snapshot.
    unpaired: Option<i64>,
    /// A seq and the writers found after it was read, waiting to settle.
    candidate: Option<(i64, Vec<i64>)>,
    /// Since when the candidate waits.
    waiting_since: Option<Instant>,
    /// When its holders were last named.
    named: Option<Instant>,
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
            let waited = state.waiting_since.map(|t| t.elapsed()).unwrap_or_default();
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
                state.waiting_since = None;
                state.named = None;
            }
            if let Some(writers) = checking.as_deref()
                && !tick.settled
                && waited >= NAME_AFTER
                && state.named.is_none_or(|t| t.elapsed() >= NAME_AFTER)
            {
                state.named = Some(Instant::now());
                name_holders(store, writers, waited).await;
            }
            if state.candidate.is_none()
                && let Some(seq) = state.unpaired
            {
                state.candidate = Some((seq, tick.writers));
                state.waiting_since = Some(Instant::now());
            }
            state.unpaired = Some(tick.last_seq);
            crate::metrics::horizon_held(
                state.waiting_since.map(|t| t.elapsed()).unwrap_or_default(),
            );
        }
        Ok(())
    }
}

/// Logs the transactions holding the horizon, one line each.
async fn name_holders(store: &Store, writers: &[i64], waited: Duration) {
    match store.horizon_holders(writers).await {
        Ok(holders) => {
            for h in holders {
                tracing::warn!(
                    xid = %h.xid,
                    pid = h.pid,
                    application = h.application.as_deref().unwrap_or_default(),
                    client = h.client.as_deref().unwrap_or_default(),
                    state = h.state.as_deref().unwrap_or_default(),
                    age_secs = h.age_secs.unwrap_or_default(),
                    prepared_gid = h.prepared_gid.as_deref().unwrap_or_default(),
                    held_for = ?waited,
                    "a transaction that wrote to outbox_events is still open: rows keep flowing, but \
                     the shards' cursors wait for it (commit, roll back or end it; a prepared one \
                     with COMMIT PREPARED or ROLLBACK PREPARED)"
                );
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, held_for = ?waited, "the settled horizon is held, and reading who holds it failed")
        }
    }
}
