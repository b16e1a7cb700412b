//! Relay settings: a builder with documented defaults.

use std::time::Duration;

use outbox_pg::HumanDuration;

use crate::error::{Error, ErrorKind, Result};
use crate::wal::WalSource;

/// The audit horizon by default ([`audit::DEFAULT_HORIZON`](crate::audit::DEFAULT_HORIZON)).
pub(crate) const DEFAULT_AUDIT_HORIZON: Duration = Duration::from_secs(15 * 60);

/// Smallest and largest accepted batch.
pub const BATCH_SIZE_RANGE: std::ops::RangeInclusive<usize> = 1..=5_000;

/// How the relay runs. Build with [`RelayConfig::default`] and the by-value
/// setters; [`RelayConfig::validate`] is called by the relay at start-up.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub(crate) batch_size: usize,
    pub(crate) poll_interval: Duration,
    pub(crate) max_attempts: i32,
    pub(crate) backoff_base: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) lease: Duration,
    pub(crate) publish_timeout: Duration,
    pub(crate) max_in_flight: usize,
    pub(crate) workers: usize,
    pub(crate) listen: bool,
    pub(crate) stats_interval: Duration,
    pub(crate) progress_interval: Duration,
    pub(crate) retention: Option<Duration>,
    pub(crate) prune_interval: Duration,
    pub(crate) prune_batch: i64,
    pub(crate) batch_bytes: usize,
    pub(crate) audit_horizon: Option<Duration>,
    pub(crate) audit_interval: Duration,
    pub(crate) audit_rows: usize,
    pub(crate) require_durable: bool,
    pub(crate) stream_refresh: Duration,
    pub(crate) source: Source,
}

/// Where the relay finds new rows.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub enum Source {
    /// Claims them from the table (the default; any number of replicas
    /// share the work).
    #[default]
    Poll,
    /// Reads them from a logical replication slot ([`crate::wal`]); one
    /// replica leads, the others stand by.
    Wal(Box<WalSource>),
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch_size: 1_000,
            poll_interval: Duration::from_millis(500),
            max_attempts: 20,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            lease: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(5),
            max_in_flight: 1_024,
            workers: 2,
            listen: true,
            stats_interval: Duration::from_secs(5),
            progress_interval: Duration::from_secs(60),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            prune_interval: Duration::from_secs(60),
            prune_batch: 1_000,
            batch_bytes: 8 * 1024 * 1024,
            audit_horizon: Some(DEFAULT_AUDIT_HORIZON),
            audit_interval: Duration::from_secs(30),
            audit_rows: 2_000,
            require_durable: false,
            stream_refresh: Duration::from_secs(30),
            source: Source::Poll,
        }
    }
}

impl RelayConfig {
    /// Reads new rows from PostgreSQL's logical decoding through `wal`
    /// instead of claiming them ([`crate::wal`]). Default: polling.
    #[must_use]
    pub fn source_wal(mut self, wal: WalSource) -> Self {
        self.source = Source::Wal(Box::new(wal));
        self
    }

    /// Where the relay finds new rows.
    pub fn source(&self) -> &Source {
        &self.source
    }

    /// Rows read per batch, split over the shards a worker reads (at least
    /// 16 per shard). Default 1,000; 1 to 5,000.
    #[must_use]
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// How often the table is polled when no notification arrives. Default 500 ms.
    #[must_use]
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// Failed publishes after which a row is left alone (and alerted on).
    /// Default 20.
    #[must_use]
    pub fn max_attempts(mut self, n: i32) -> Self {
        self.max_attempts = n;
        self
    }

    /// First retry delay after a failure; it doubles per attempt. Default 1 s.
    #[must_use]
    pub fn backoff_base(mut self, d: Duration) -> Self {
        self.backoff_base = d;
        self
    }

    /// Cap on the retry delay. Default 5 min.
    #[must_use]
    pub fn backoff_max(mut self, d: Duration) -> Self {
        self.backoff_max = d;
        self
    }

    /// How long a relay that stops answering (frozen, cut off) keeps its
    /// shards before another replica takes them over; also the bound on one
    /// batch, publishing and marking. At least twice the publish timeout, and
    /// the stream's duplicate window must exceed lease + publish timeout.
    /// Default 30 s.
    #[must_use]
    pub fn lease(mut self, d: Duration) -> Self {
        self.lease = d;
        self
    }

    /// Bound on one publish and its JetStream ack. Default 5 s.
    #[must_use]
    pub fn publish_timeout(mut self, d: Duration) -> Self {
        self.publish_timeout = d;
        self
    }

    /// Publishes awaiting their ack at once (one per subject). Default 1,024.
    #[must_use]
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// Claim → publish → mark loops run concurrently by this relay, so one
    /// loop's database work overlaps another's publishing. Any number is safe:
    /// loops coordinate through the table exactly as replicas do. Default 2.
    #[must_use]
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }

    /// Wake on `LISTEN outbox_events` notifications, not only by polling.
    /// Default on.
    #[must_use]
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self
    }

    /// How often backlog gauges are refreshed. Default 5 s.
    #[must_use]
    pub fn stats_interval(mut self, d: Duration) -> Self {
        self.stats_interval = d;
        self
    }

    /// How often the relay logs, at info, what it published since the line
    /// before, the backlog and the age of the oldest unpublished row; zero
    /// logs none. Default 1 min.
    #[must_use]
    pub fn progress_interval(mut self, d: Duration) -> Self {
        self.progress_interval = d;
        self
    }

    /// Published rows older than this are deleted; `None` keeps them forever.
    /// Default 7 days.
    #[must_use]
    pub fn retention(mut self, window: Option<Duration>) -> Self {
        self.retention = window;
        self
    }

    /// How often the pruner runs. Default 60 s.
    #[must_use]
    pub fn prune_interval(mut self, d: Duration) -> Self {
        self.prune_interval = d;
        self
    }

    /// Bound on the bytes of one batch (payloads and attributes), so large
    /// payloads cannot exhaust a relay's memory: rows past it wait for the next
    /// batch (a batch always takes at least one row). Default 8 MiB.
    #[must_use]
    pub fn batch_bytes(mut self, bytes: usize) -> Self {
        self.batch_bytes = bytes;
        self
    }

    /// How far back the audit reads published rows' messages from the stream
    /// (see [`audit`](crate::audit)): rows published within this horizon and
    /// longer ago than the stream's duplicate window plus a margin
    /// ([`settle_margin`](crate::audit::settle_margin)). `None` turns the audit
    /// off (warned at start, refused with [`require_durable`](Self::require_durable)).
    /// Default 15 min. Only a relay on JetStream ([`Relay::jetstream`](crate::Relay::jetstream))
    /// audits.
    #[must_use]
    pub fn audit_horizon(mut self, horizon: Option<Duration>) -> Self {
        self.audit_horizon = horizon;
        self
    }

    /// Pause between audit passes. Default 30 s.
    #[must_use]
    pub fn audit_interval(mut self, d: Duration) -> Self {
        self.audit_interval = d;
        self
    }

    /// Bound on the rows one audit pass checks (the rest wait for the next
    /// pass). Default 2,000.
    #[must_use]
    pub fn audit_rows(mut self, n: usize) -> Self {
        self.audit_rows = n;
        self
    }

    /// Refuse to start on a durability that can lose acknowledged events:
    /// a stream with one replica or memory storage, or the audit off.
    /// Default off (each is a warning at start).
    #[must_use]
    pub fn require_durable(mut self, on: bool) -> Self {
        self.require_durable = on;
        self
    }

    /// How often a running relay reads its stream's config again (subjects,
    /// `max_msg_size`, limits, storage, replicas), so that it follows edits
    /// made while it runs; it is also read at once when a row looks
    /// uncapturable or the broker refuses a message. A row whose type the
    /// stream, read again, does not capture waits this long in the retry
    /// lane before it is tried again, without counting an attempt. Default
    /// 30 s.
    #[must_use]
    pub fn stream_refresh(mut self, d: Duration) -> Self {
        self.stream_refresh = d;
        self
    }

    /// The longest a republish of a row can come after its first publish
    /// (lease plus publish timeout): the stream's duplicate window must be
    /// longer, so that the republish is dropped as a duplicate.
    pub fn republish_horizon(&self) -> Duration {
        self.lease + self.publish_timeout
    }

    /// Checks ranges and relations between settings.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] naming the setting that is out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::new(ErrorKind::Config, msg));
        if !BATCH_SIZE_RANGE.contains(&self.batch_size) {
            return bad(format!(
                "batch size {} is outside {}..={}",
                self.batch_size,
                BATCH_SIZE_RANGE.start(),
                BATCH_SIZE_RANGE.end()
            ));
        }
        if self.max_attempts < 1 {
            return bad(format!(
                "max attempts {} must be at least 1",
                self.max_attempts
            ));
        }
        if self.poll_interval.is_zero() {
            return bad("poll interval must be positive".into());
        }
        if self.backoff_base.is_zero() || self.backoff_max < self.backoff_base {
            return bad(format!(
                "backoff base {} must be positive and at most the cap {}",
                HumanDuration(self.backoff_base),
                HumanDuration(self.backoff_max)
            ));
        }
        if self.publish_timeout.is_zero() {
            return bad("publish timeout must be positive".into());
        }
        if self.lease < self.publish_timeout * 2 {
            return bad(format!(
                "lease {} must be at least twice the publish timeout {}",
                HumanDuration(self.lease),
                HumanDuration(self.publish_timeout)
            ));
        }
        if !(1..=64).contains(&self.workers) {
            return bad(format!("workers {} is outside 1..=64", self.workers));
        }
        if self.max_in_flight == 0 {
            return bad("max in flight must be at least 1".into());
        }
        if self.batch_bytes == 0 {
            return bad("batch bytes must be positive".into());
        }
        if self.audit_horizon.is_some_and(|h| h.is_zero()) {
            return bad("audit horizon must be positive (or disabled)".into());
        }
        if self.audit_interval.is_zero() {
            return bad("audit interval must be positive".into());
        }
        if self.audit_rows == 0 {
            return bad("audit rows per pass must be at least 1".into());
        }
        if self.stream_refresh.is_zero() {
            return bad("stream refresh interval must be positive".into());
        }
        if self.retention.is_some_and(|r| r.is_zero()) {
            return bad("retention window must be positive (or disabled)".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        RelayConfig::default().validate().unwrap();
    }

    #[test]
    fn out_of_range_values_are_named() {
        let err = RelayConfig::default().batch_size(0).validate().unwrap_err();
        assert!(err.to_string().contains("batch size"));
        let err = RelayConfig::default()
            .batch_size(5_001)
            .validate()
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        let err = RelayConfig::default()
            .max_attempts(0)
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("max attempts"));
        let err = RelayConfig::default()
            .lease(Duration::from_secs(1))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("lease"));
    }

    #[test]
    fn the_audit_settings_are_checked_and_the_republish_horizon_is_lease_plus_timeout() {
        let config = RelayConfig::default();
        assert_eq!(config.audit_horizon, Some(Duration::from_secs(900)));
        assert_eq!(config.republish_horizon(), Duration::from_secs(35));
        assert!(!config.require_durable);
        RelayConfig::default()
            .audit_horizon(None)
            .validate()
            .unwrap();
        let err = RelayConfig::default()
            .audit_horizon(Some(Duration::ZERO))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("audit horizon"), "{err}");
        let err = RelayConfig::default()
            .audit_interval(Duration::ZERO)
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("audit interval"), "{err}");
        let err = RelayConfig::default().audit_rows(0).validate().unwrap_err();
        assert!(err.to_string().contains("audit rows"), "{err}");
        assert_eq!(
            RelayConfig::default().stream_refresh,
            Duration::from_secs(30)
        );
        let err = RelayConfig::default()
            .stream_refresh(Duration::ZERO)
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("stream refresh"), "{err}");
    }
}
