//! Retry delays: exponential with jitter, capped.
//!
//! A row's delay is a function of its attempt count, which the row keeps
//! (`attempts`), so it is computed here rather than drawn from an iterator
//! that starts at the first attempt in each process; the loops' pauses are
//! backon's.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use rand::Rng;

/// `base · 2^(attempt-1)`, capped at `max`, then jittered by ±20 % (and capped
/// again): 1 s, 2 s, 4 s … 5 min with the defaults.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    base: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) const fn new(base: Duration, max: Duration) -> Self {
        Self { base, max }
    }

    /// The delay before the next try, after `attempt` failures (`attempt >= 1`).
    pub(crate) fn delay(&self, attempt: u32) -> Duration {
        self.jittered(self.nominal(attempt), rand::rng().random_range(0.8..=1.2))
    }

    /// The delay without jitter.
    pub(crate) fn nominal(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(32);
        self.base
            .checked_mul(1u32 << exp.min(31))
            .unwrap_or(self.max)
            .min(self.max)
    }

    fn jittered(&self, nominal: Duration, factor: f64) -> Duration {
        nominal.mul_f64(factor).min(self.max)
    }
}

/// Exponential pause for the loop itself (not per row), without jitter:
/// [`outbox_pg::ready::pauses`] (backon), from the first pause again after
/// [`reset`](Self::reset).
#[derive(Debug)]
pub(crate) struct LoopBackoff {
    pauses: ExponentialBuilder,
    current: ExponentialBackoff,
    max: Duration,
}

impl LoopBackoff {
    pub(crate) fn new(base: Duration, max: Duration) -> Self {
        let pauses = outbox_pg::ready::pauses(base, max);
        Self {
            pauses,
            current: pauses.build(),
            max,
        }
    }

    pub(crate) fn next(&mut self) -> Duration {
        // The pauses have no end; `max` only if that ever changed.
        self.current.next().unwrap_or(self.max)
    }

    pub(crate) fn reset(&mut self) {
        self.current = self.pauses.build();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b() -> Backoff {
        Backoff::new(Duration::from_secs(1), Duration::from_secs(300))
    }

    #[test]
    fn doubles_from_the_base() {
        let secs: Vec<u64> = (1..=6).map(|a| b().nominal(a).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32]);
    }

    #[test]
    fn is_capped_even_for_huge_attempt_counts() {
        assert_eq!(b().nominal(9).as_secs(), 256);
        assert_eq!(b().nominal(10), Duration::from_secs(300));
        assert_eq!(b().nominal(u32::MAX), Duration::from_secs(300));
        assert!(b().delay(1_000) <= Duration::from_secs(300));
    }

    #[test]
    fn jitter_stays_within_twenty_percent() {
        for attempt in 1..=8 {
            let nominal = b().nominal(attempt);
            for _ in 0..50 {
                let d = b().delay(attempt);
                assert!(
                    d >= nominal.mul_f64(0.8) && d <= nominal.mul_f64(1.2),
                    "{d:?}"
                );
            }
        }
        assert_eq!(
            b().jittered(Duration::from_secs(300), 1.2),
            Duration::from_secs(300)
        );
    }

    #[test]
    fn loop_backoff_doubles_to_its_cap_and_resets() {
        let mut b = LoopBackoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let seq: Vec<u128> = (0..4).map(|_| b.next().as_millis()).collect();
        assert_eq!(seq, [100, 200, 350, 350]);
        b.reset();
        assert_eq!(b.next().as_millis(), 100);
    }
}
