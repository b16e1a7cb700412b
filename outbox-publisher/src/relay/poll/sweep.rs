//! When the polling workers may sleep: once the parts of the owned shards
//! read to their end since the wake-up, by any worker, and the parts being
//! read now add up to every part ([`Sweep`]).
//!
//! Every worker wakes on a commit's NOTIFY. Counted per worker, each read
//! every part before it slept: with two workers, a lone event cost about four
//! claims (the one that found it, then the parts around it, twice). Counted
//! together, the workers sleep after as many claims as there are parts.
//!
//! Nothing is missed:
//! - a row committed after a worker took its wake-up is announced by a
//!   NOTIFY of its own, which wakes it again, and one committed before is
//!   seen by the claims that follow;
//! - a worker sleeps beside a claim still running only if that claim would
//!   complete the sweep; if it finds more to read instead, it wakes the
//!   sleepers ([`Sweep::woken`]), so a burst is read by every worker.

use std::sync::Mutex;

use tokio::sync::watch;

/// The workers' sweep of the owned shards since the last wake-up (see the
/// module docs).
#[derive(Debug)]
pub(super) struct Sweep {
    count: Mutex<Count>,
    /// Changed whenever a claim finds more to read.
    more: watch::Sender<u64>,
}

/// The wake-up counted from, the parts read to their end since then, and
/// the claims running.
#[derive(Debug, Default, Clone, Copy)]
struct Count {
    wake: u64,
    read: usize,
    running: usize,
}

impl Default for Sweep {
    fn default() -> Self {
        Self {
            count: Mutex::default(),
            more: watch::channel(0).0,
        }
    }
}

impl Sweep {
    fn count(&self) -> std::sync::MutexGuard<'_, Count> {
        self.count.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A worker woken at `wake` starts a claim.
    pub(super) fn claiming(&self, wake: u64) {
        let mut count = self.count();
        if count.wake != wake {
            count.wake = wake;
            count.read = 0;
        }
        count.running += 1;
    }

    /// A claim ended: `to_end`, it read its part to the end; else it found
    /// more (the sleeping workers are woken) or failed (`more` false).
    /// Whether the workers may sleep: the parts read to the end and those
    /// being read cover all `parts`.
    pub(super) fn claimed(&self, to_end: bool, more: bool, parts: usize) -> bool {
        let mut count = self.count();
        count.running = count.running.saturating_sub(1);
        if to_end {
            count.read += 1;
            return count.read + count.running >= parts;
        }
        count.read = 0;
        drop(count);
        if more {
            self.more.send_modify(|n| *n = n.wrapping_add(1));
        }
        false
    }

    /// A worker woke by itself (the poll interval, a change of owned
    /// shards): count again from nothing.
    pub(super) fn restart(&self) {
        self.count().read = 0;
    }

    /// Changes whenever a claim finds more to read: a sleeping worker
    /// wakes on it.
    pub(super) fn subscribe(&self) -> watch::Receiver<u64> {
        self.more.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workers_sleep_once_their_claims_cover_every_part() {
        let sweep = Sweep::default();
        // Two workers woken by the same NOTIFY (wake-up 1), one part each:
        // the first to finish sleeps, the other's claim completing the sweep.
        sweep.claiming(1);
        sweep.claiming(1);
        assert!(sweep.claimed(true, false, 2));
        assert!(sweep.claimed(true, false, 2));
        // A new wake-up counts from nothing.
        sweep.claiming(2);
        assert!(!sweep.claimed(true, false, 2));
        // A part with more to read restarts the count.
        sweep.claiming(2);
        assert!(!sweep.claimed(false, true, 2));
        sweep.claiming(2);
        assert!(!sweep.claimed(true, false, 2));
        sweep.claiming(2);
        assert!(sweep.claimed(true, false, 2));
        // One worker: each read to the end covers every part.
        sweep.claiming(3);
        assert!(sweep.claimed(true, false, 1));
    }

    #[test]
    fn a_claim_finding_more_wakes_the_sleepers() {
        let sweep = Sweep::default();
        let mut more = sweep.subscribe();
        more.borrow_and_update();
        sweep.claiming(1);
        sweep.claimed(true, false, 2);
        assert!(!more.has_changed().unwrap());
        sweep.claiming(1);
        sweep.claimed(false, true, 2);
        assert!(more.has_changed().unwrap());
    }
}
