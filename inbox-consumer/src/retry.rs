//! [`RetryPolicy`]: how long a failed delivery waits before it is tried again.

use std::time::Duration;

/// How long to wait before a failed delivery is redelivered: exponential in
/// the delivery count, `base · 2^(delivered−1)`, capped at `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    base: Duration,
    max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            base: Duration::from_secs(1),
            max: Duration::from_secs(5 * 60),
        }
    }
}

impl RetryPolicy {
    /// The delay after the first failed delivery. Default: 1 s.
    #[must_use]
    pub fn base(mut self, base: Duration) -> Self {
        self.base = base;
        self
    }

    /// The longest delay. Default: 5 min.
    #[must_use]
    pub fn max(mut self, max: Duration) -> Self {
        self.max = max;
        self
    }

    /// The nak delay after delivery number `delivered` (1-based) failed.
    pub fn delay(&self, delivered: u64) -> Duration {
        let exponent = u32::try_from(delivered.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(32);
        let factor = 1u32.checked_shl(exponent).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_doubles_per_delivery_and_caps() {
        let p = RetryPolicy::default()
            .base(Duration::from_millis(100))
            .max(Duration::from_secs(1));
        assert_eq!(p.delay(0), Duration::from_millis(100));
        assert_eq!(p.delay(1), Duration::from_millis(100));
        assert_eq!(p.delay(2), Duration::from_millis(200));
        assert_eq!(p.delay(4), Duration::from_millis(800));
        assert_eq!(p.delay(5), Duration::from_secs(1));
        assert_eq!(p.delay(u64::MAX), Duration::from_secs(1));
    }
}
