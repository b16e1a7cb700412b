//! How the relay runs, as flags: [`RelayArgs`] (`--batch-size`,
//! `--workers`, `--lease`, the retry backoff, retention, the audit, …)
//! builds the [`RelayConfig`] those flags describe.

use std::time::Duration;

use crate::RelayConfig;

/// The relay's settings, as flags and environment variables, with the
/// defaults of [`RelayConfig::default`]. `#[command(flatten)]` it into a
/// binary's arguments; [`config`](Self::config) is the configuration they
/// describe (reading new rows by polling; see
/// [`SourceArgs`](super::SourceArgs) for the WAL).
#[derive(Debug, Clone, clap::Args)]
pub struct RelayArgs {
    /// How often the stream's config (subjects, limits) is read again while
    /// the relay runs; it is also read at once when a row's type looks
    /// uncaptured or the broker refuses a message. A row whose type the
    /// stream does not capture waits this long before it is tried again,
    /// without losing an attempt.
    #[arg(long, env = "OUTBOX_STREAM_REFRESH", default_value = "30s", value_parser = humantime::parse_duration)]
    stream_refresh: Duration,

    /// Rows read per batch (1–5000).
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 1000)]
    batch_size: usize,

    /// Concurrent claim → publish → mark loops in this process.
    #[arg(long, env = "OUTBOX_WORKERS", default_value_t = 2)]
    workers: usize,

    /// Poll interval when no notification arrives (e.g. 500ms).
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "500ms", value_parser = humantime::parse_duration)]
    poll_interval: Duration,

    /// Failed publishes after which a row is left alone.
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS", default_value_t = 20)]
    max_attempts: i32,

    /// First retry delay after a failure; doubles per attempt.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    backoff_base: Duration,

    /// Cap on the retry delay.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    max_backoff: Duration,

    /// How often to log, at info, what this relay published since the line
    /// before, the backlog and the age of the oldest unpublished row; 0 logs none.
    #[arg(long, env = "OUTBOX_PROGRESS_INTERVAL", default_value = "1m", value_parser = humantime::parse_duration)]
    progress_interval: Duration,

    /// Bound on one publish and its PubAck.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    publish_timeout: Duration,

    /// How long a relay that stops answering keeps its shards before another
    /// replica takes them over; also bounds one batch. The stream's duplicate
    /// window must be longer than this plus the publish timeout.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    lease: Duration,

    /// Delete published rows older than this (e.g. 7d); 0 disables retention.
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "7d", value_parser = humantime::parse_duration)]
    retention: Duration,

    /// Audit rows published within this horizon: read each one's message back
    /// from the stream by its PubAck sequence and publish again a row whose
    /// message the stream lost (rows younger than the duplicate window plus a
    /// quarter of it, 1–30 s, wait). 0 disables the audit.
    #[arg(long, env = "OUTBOX_AUDIT_HORIZON", default_value = "15m", value_parser = humantime::parse_duration)]
    audit_horizon: Duration,

    /// Pause between audit passes.
    #[arg(long, env = "OUTBOX_AUDIT_INTERVAL", default_value = "30s", value_parser = humantime::parse_duration)]
    audit_interval: Duration,

    /// Refuse to start on a durability that can lose acknowledged events: a
    /// stream with 1 replica or memory storage, or the audit disabled.
    #[arg(long, env = "OUTBOX_REQUIRE_DURABLE")]
    require_durable: bool,
}

impl RelayArgs {
    /// The configuration the flags describe, not yet
    /// [validated](RelayConfig::validate) (the relay validates it at start).
    /// A zero `--retention` or `--audit-horizon` turns that task off.
    pub fn config(&self) -> RelayConfig {
        RelayConfig::default()
            .batch_size(self.batch_size)
            .workers(self.workers)
            .poll_interval(self.poll_interval)
            .max_attempts(self.max_attempts)
            .backoff_base(self.backoff_base)
            .backoff_max(self.max_backoff)
            .publish_timeout(self.publish_timeout)
            .lease(self.lease)
            .retention(unless_zero(self.retention))
            .audit_horizon(unless_zero(self.audit_horizon))
            .audit_interval(self.audit_interval)
            .require_durable(self.require_durable)
            .stream_refresh(self.stream_refresh)
            .progress_interval(self.progress_interval)
    }
}

/// `d`, or `None` (the task off) for zero.
fn unless_zero(d: Duration) -> Option<Duration> {
    (!d.is_zero()).then_some(d)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Args {
        #[command(flatten)]
        relay: RelayArgs,
    }

    fn parse(args: &[&str]) -> RelayArgs {
        let argv = std::iter::once("relay").chain(args.iter().copied());
        match Args::try_parse_from(argv) {
            Ok(args) => args.relay,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn the_defaults_are_the_library_defaults() {
        let from_flags = format!("{:?}", parse(&[]).config());
        assert_eq!(from_flags, format!("{:?}", RelayConfig::default()));
    }

    #[test]
    fn zero_turns_retention_and_the_audit_off() {
        let config = parse(&["--retention", "0s", "--audit-horizon", "0s"]).config();
        assert_eq!(config.retention, None);
        assert_eq!(config.audit_horizon, None);
    }
}
