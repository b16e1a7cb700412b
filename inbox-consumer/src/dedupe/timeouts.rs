//! [`Timeouts`]: bounds on the waits of a handler's transaction.

use std::time::Duration;

/// Bounds on the waits of every transaction [`Dedupe`](super::Dedupe) begins,
/// set with `SET LOCAL` in the statement that begins it (no extra round trip).
///
/// - **Lock timeout** (default 5 s): the inbox insert waits on the row of a
///   replica handling the same event, [`SkipStale`](crate::SkipStale) on its
///   subject's lock, and handlers on their own locks. A wait that runs out
///   rolls back and is retried, logged with the subject; it never spends the
///   delivery budget.
/// - **Statement timeout** (default 30 s): one statement running longer rolls
///   back and is retried like any handler failure.
/// - **Idle-in-transaction timeout** (default 60 s): a transaction left open
///   while its process is frozen (stopped, swapped out, cut off) is ended by
///   the server, so the locks it holds (its inbox row, its subject) pass to
///   the replica that gets the redelivery, instead of blocking until TCP
///   gives up.
///
/// A zero duration disables that bound (PostgreSQL's `0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    lock: Duration,
    statement: Duration,
    idle_in_transaction: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            lock: Duration::from_secs(5),
            statement: Duration::from_secs(30),
            idle_in_transaction: Duration::from_secs(60),
        }
    }
}

impl Timeouts {
    /// Longest wait for a lock (`lock_timeout`). Default: 5 s.
    #[must_use]
    pub fn lock(mut self, timeout: Duration) -> Self {
        self.lock = timeout;
        self
    }

    /// Longest run of one statement (`statement_timeout`). Default: 30 s.
    #[must_use]
    pub fn statement(mut self, timeout: Duration) -> Self {
        self.statement = timeout;
        self
    }

    /// Longest idle time inside the transaction
    /// (`idle_in_transaction_session_timeout`). Default: 60 s.
    #[must_use]
    pub fn idle_in_transaction(mut self, timeout: Duration) -> Self {
        self.idle_in_transaction = timeout;
        self
    }

    /// `BEGIN` with the three settings, as one simple-query string.
    pub(crate) fn begin_statement(&self) -> String {
        format!(
            "BEGIN; SET LOCAL lock_timeout = {}; SET LOCAL statement_timeout = {}; \
             SET LOCAL idle_in_transaction_session_timeout = {}",
            millis(self.lock),
            millis(self.statement),
            millis(self.idle_in_transaction),
        )
    }
}

/// Whole milliseconds, at least 1 for a non-zero duration (0 disables), at
/// most PostgreSQL's limit for these settings.
fn millis(d: Duration) -> u128 {
    if d.is_zero() {
        0
    } else {
        d.as_millis().clamp(1, i32::MAX as u128)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_begin_statement_sets_each_bound_in_milliseconds() {
        let t = Timeouts::default()
            .lock(Duration::from_millis(1500))
            .statement(Duration::ZERO)
            .idle_in_transaction(Duration::from_micros(10));
        assert_eq!(
            t.begin_statement(),
            "BEGIN; SET LOCAL lock_timeout = 1500; SET LOCAL statement_timeout = 0; \
             SET LOCAL idle_in_transaction_session_timeout = 1"
        );
        let huge = Timeouts::default().lock(Duration::from_secs(u64::MAX));
        assert!(
            huge.begin_statement()
                .contains("lock_timeout = 2147483647;")
        );
    }
}
