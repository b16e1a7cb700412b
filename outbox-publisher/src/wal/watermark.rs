//! The WAL source's confirm rule: how far the replication slot may be
//! confirmed, kept apart from any I/O so that it can be tested on its own.
//!
//! # The rule
//!
//! Every row the pipeline takes from the stream is *handed out* a number, in
//! read order. Every commit read remembers the number the next row would
//! get: its rows, and every row read before them, have lower numbers. A row
//! is *resolved* once its outcome is written to the table (its mark, its
//! failure, its deferral). The slot may be confirmed up to the last commit
//! whose remembered number is at most the lowest unresolved number: every
//! row of that transaction, and of every transaction before it, is resolved.
//!
//! # Why it is safe
//!
//! After a crash PostgreSQL streams again from the confirmed position, so
//! each transaction past it is read again. A transaction at or before it
//! has every row resolved: its outcome is in the table, where the polling
//! path (the retry lane) or the stream (a published row) holds it. So no
//! row is lost, whatever order outcomes land in; a row resolved early (a
//! mark that lands before an earlier row's) moves nothing until every row
//! before it is resolved, and the rows read again are published again with
//! the same id, which the stream's duplicate window drops.
//!
//! - A transaction that ends at or before the confirmed position is a
//!   *replay* (a new session reads from the slot's position, which may lie
//!   before transactions already confirmed by the last one): its rows were
//!   resolved before; none is handed out and its commit is not remembered.
//! - A transaction with no row of ours (an *empty* one, for this reader)
//!   remembers the same number as the commit before it, so it is confirmed
//!   as soon as that one may be.
//! - While nothing is held (no unresolved row, no commit waiting, no
//!   transaction open), a keep-alive's position may be confirmed: an idle
//!   outbox must not hold WAL back.

use std::collections::{BTreeSet, VecDeque};

use pgwire_replication::Lsn;

/// A commit read and not yet confirmed.
#[derive(Debug, Clone, Copy)]
struct Commit {
    /// The number after its last row.
    end: u64,
    /// Where it ends in the WAL.
    lsn: Lsn,
    /// Its commit time, microseconds since 2000-01-01.
    micros: i64,
}

/// Rows handed out, rows resolved, commits seen, and the position that may
/// be confirmed (see the module docs).
#[derive(Debug)]
pub(super) struct Watermark {
    /// Every transaction ending at or before it has every row resolved.
    done: Lsn,
    /// The number the next row gets.
    next: u64,
    /// Numbers handed out and not resolved.
    unresolved: BTreeSet<u64>,
    /// Commits read and not confirmed, in read order.
    commits: VecDeque<Commit>,
    /// A transaction is open (a Begin read, its Commit not yet).
    in_txn: bool,
    /// The open transaction was confirmed before: a replay.
    replay: bool,
}

impl Watermark {
    /// A watermark for a session that reads from after `done`.
    pub(super) fn new(done: Lsn) -> Self {
        Self {
            done,
            next: 0,
            unresolved: BTreeSet::new(),
            commits: VecDeque::new(),
            in_txn: false,
            replay: false,
        }
    }

    /// The position confirmed so far.
    #[cfg(test)]
    pub(super) fn done(&self) -> Lsn {
        self.done
    }

    /// A transaction begins that ends at `final_lsn`.
    pub(super) fn begin(&mut self, final_lsn: Lsn) {
        self.in_txn = true;
        self.replay = final_lsn < self.done;
    }

    /// Whether the open transaction is a replay: its rows are not taken.
    pub(super) fn replaying(&self) -> bool {
        self.replay
    }

    /// Hands out the number of a row of the open transaction.
    pub(super) fn hand_out(&mut self) -> u64 {
        let number = self.next;
        self.next += 1;
        self.unresolved.insert(number);
        number
    }

    /// The open transaction commits, ending at `lsn` at `micros` (since
    /// 2000-01-01).
    pub(super) fn commit(&mut self, lsn: Lsn, micros: i64) {
        self.in_txn = false;
        if !self.replay {
            self.commits.push_back(Commit {
                end: self.next,
                lsn,
                micros,
            });
        }
        self.replay = false;
    }

    /// The row numbered `number` has its outcome written.
    pub(super) fn resolve(&mut self, number: u64) {
        self.unresolved.remove(&number);
    }

    /// Rows handed out and not resolved.
    pub(super) fn unresolved(&self) -> usize {
        self.unresolved.len()
    }

    /// The position that may be confirmed now, if it moved: the end of the
    /// last commit none of whose rows, nor any row before them, is
    /// unresolved.
    pub(super) fn confirm(&mut self) -> Option<Lsn> {
        let low = self.unresolved.first().copied().unwrap_or(u64::MAX);
        let mut to = None;
        while let Some(commit) = self.commits.front() {
            if commit.end > low {
                break;
            }
            to = Some(commit.lsn);
            self.commits.pop_front();
        }
        if let Some(lsn) = to {
            self.done = lsn;
        }
        to
    }

    /// A keep-alive at `wal_end`: the position to confirm when nothing is
    /// held and it is past the confirmed one.
    pub(super) fn idle(&mut self, wal_end: Lsn) -> Option<Lsn> {
        let idle = self.unresolved.is_empty() && self.commits.is_empty() && !self.in_txn;
        if idle && wal_end > self.done {
            self.done = wal_end;
            return Some(wal_end);
        }
        None
    }

    /// The commit time of the oldest commit not confirmed (microseconds
    /// since 2000-01-01).
    pub(super) fn oldest_commit(&self) -> Option<i64> {
        self.commits.front().map(|c| c.micros)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn lsn(n: u64) -> Lsn {
        Lsn(n)
    }

    /// A transaction ending at `end` with `rows` rows; their numbers.
    fn txn(w: &mut Watermark, end: u64, rows: usize) -> Vec<u64> {
        w.begin(lsn(end));
        let numbers = (0..rows).map(|_| w.hand_out()).collect();
        w.commit(lsn(end), 0);
        numbers
    }

    #[test]
    fn never_confirms_past_an_unresolved_row() {
        let mut w = Watermark::new(lsn(0));
        let a = txn(&mut w, 10, 2);
        let b = txn(&mut w, 20, 1);
        assert_eq!(w.confirm(), None);
        // The second transaction resolved: still behind the first.
        w.resolve(b[0]);
        assert_eq!(w.confirm(), None);
        // One row of the first only.
        w.resolve(a[1]);
        assert_eq!(w.confirm(), None);
        w.resolve(a[0]);
        assert_eq!(w.confirm(), Some(lsn(20)));
        assert_eq!(w.done(), lsn(20));
        assert_eq!(w.confirm(), None);
    }

    #[test]
    fn out_of_order_resolution_confirms_the_longest_resolved_prefix() {
        let mut w = Watermark::new(lsn(0));
        let a = txn(&mut w, 10, 1);
        let b = txn(&mut w, 20, 1);
        let c = txn(&mut w, 30, 1);
        w.resolve(c[0]);
        w.resolve(a[0]);
        assert_eq!(w.confirm(), Some(lsn(10)));
        w.resolve(b[0]);
        assert_eq!(w.confirm(), Some(lsn(30)));
        assert_eq!(w.unresolved(), 0);
    }

    #[test]
    fn a_replayed_transaction_is_skipped_and_remembers_no_commit() {
        let mut w = Watermark::new(lsn(50));
        w.begin(lsn(40));
        assert!(w.replaying());
        w.commit(lsn(40), 0);
        assert!(!w.replaying());
        assert_eq!(w.confirm(), None);
        assert_eq!(w.oldest_commit(), None);
        // The next one is new.
        w.begin(lsn(60));
        assert!(!w.replaying());
        let n = w.hand_out();
        w.commit(lsn(60), 7);
        assert_eq!(w.oldest_commit(), Some(7));
        w.resolve(n);
        assert_eq!(w.confirm(), Some(lsn(60)));
    }

    #[test]
    fn an_empty_transaction_is_confirmed_with_the_one_before_it() {
        let mut w = Watermark::new(lsn(0));
        let a = txn(&mut w, 10, 1);
        txn(&mut w, 20, 0);
        assert_eq!(w.confirm(), None);
        w.resolve(a[0]);
        assert_eq!(w.confirm(), Some(lsn(20)));
        // Empty transactions alone are confirmed at once.
        txn(&mut w, 30, 0);
        assert_eq!(w.confirm(), Some(lsn(30)));
    }

    #[test]
    fn a_keep_alive_moves_the_slot_only_while_nothing_is_held() {
        let mut w = Watermark::new(lsn(5));
        assert_eq!(w.idle(lsn(8)), Some(lsn(8)));
        assert_eq!(w.idle(lsn(8)), None);
        w.begin(lsn(20));
        assert_eq!(w.idle(lsn(9)), None, "a transaction is open");
        let n = w.hand_out();
        w.commit(lsn(20), 0);
        assert_eq!(w.idle(lsn(25)), None, "a row is unresolved");
        w.resolve(n);
        assert_eq!(w.idle(lsn(25)), None, "a commit waits to be confirmed");
        assert_eq!(w.confirm(), Some(lsn(20)));
        assert_eq!(w.idle(lsn(25)), Some(lsn(25)));
    }

    /// Transactions of 0 to 3 rows, and an order in which their rows are
    /// resolved, with confirms asked between resolutions.
    fn interleaving() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
        prop::collection::vec(0usize..4, 1..12).prop_flat_map(|sizes| {
            let rows: usize = sizes.iter().sum();
            let order = Just((0..rows).collect::<Vec<_>>()).prop_shuffle();
            (Just(sizes), order)
        })
    }

    proptest! {
        #[test]
        fn the_confirmed_position_never_passes_an_unresolved_row((sizes, order) in interleaving()) {
            let mut w = Watermark::new(lsn(0));
            // Each transaction's end, and its rows' numbers.
            let mut txns: Vec<(u64, Vec<u64>)> = Vec::new();
            for (i, &size) in sizes.iter().enumerate() {
                let end = (i as u64 + 1) * 10;
                txns.push((end, txn(&mut w, end, size)));
            }
            let all: Vec<u64> = txns.iter().flat_map(|t| t.1.clone()).collect();
            let mut resolved = std::collections::HashSet::new();
            let mut last = lsn(0);
            for &i in &order {
                w.resolve(all[i]);
                resolved.insert(all[i]);
                if let Some(to) = w.confirm() {
                    prop_assert!(to > last, "the position only moves forward");
                    last = to;
                }
                // Every transaction ending at or before the confirmed
                // position has every row resolved, and so has every one
                // before it.
                for (end, rows) in &txns {
                    if lsn(*end) <= w.done() {
                        prop_assert!(rows.iter().all(|n| resolved.contains(n)));
                    }
                }
            }
            // All resolved: confirmed to the last commit.
            w.confirm();
            prop_assert_eq!(w.done(), lsn(sizes.len() as u64 * 10));
            prop_assert_eq!(w.unresolved(), 0);
        }
    }
}
