//! What the relay says it is doing, at info: one line at start naming the
//! stream, its subjects and the source, and one every `progress_interval`
//! (1 min) with what this relay published since the line before, the
//! table's backlog and the age of its oldest unpublished row. So an operator
//! reading the log sees the relay work (or stall) without querying
//! `published_at`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_pg::HumanDuration;
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::Engine;
use super::chain::Outcome;
use crate::config::RelayConfig;
use crate::sink::Sink;
use crate::store::ClaimedRow;

/// How long the progress line waits for the backlog figures.
const STATS_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a JetStream relay publishes, for its start line.
#[derive(Debug, Clone)]
pub(in crate::relay) struct Target {
    pub(in crate::relay) stream: String,
    pub(in crate::relay) subjects: Vec<String>,
}

/// Rows this relay published (PubAcks) since the last progress line.
#[derive(Debug, Default)]
pub(in crate::relay) struct Tally {
    published: AtomicU64,
    duplicates: AtomicU64,
}

impl Tally {
    /// Counts the published rows among a chain's outcomes.
    pub(in crate::relay) fn count(&self, out: &[(ClaimedRow, Outcome)]) {
        let (mut published, mut duplicates) = (0, 0);
        for (_, outcome) in out {
            if let Outcome::Published { duplicate, .. } = outcome {
                published += 1;
                duplicates += u64::from(*duplicate);
            }
        }
        if published > 0 {
            self.published.fetch_add(published, Ordering::Relaxed);
            self.duplicates.fetch_add(duplicates, Ordering::Relaxed);
        }
    }

    /// The counts since the last call.
    fn take(&self) -> (u64, u64) {
        (
            self.published.swap(0, Ordering::Relaxed),
            self.duplicates.swap(0, Ordering::Relaxed),
        )
    }
}

/// The start line of a relay publishing to `target` (none: a custom sink).
pub(in crate::relay) fn log_start(
    config: &RelayConfig,
    target: Option<&Target>,
    source: &'static str,
) {
    let (stream, subjects) = match target {
        Some(t) => (t.stream.as_str(), t.subjects.join(",")),
        None => ("(custom sink)", String::new()),
    };
    info!(
        stream = %stream,
        subjects = %subjects,
        source = %source,
        batch_size = config.batch_size,
        workers = config.workers,
        poll_interval = %HumanDuration(config.poll_interval),
        max_attempts = config.max_attempts,
        "outbox relay started"
    );
}

impl<S: Sink> Engine<S> {
    /// Every `progress_interval` until `shutdown`, the progress line (none
    /// when the interval is zero).
    pub(in crate::relay) async fn progress_loop(&self, shutdown: &CancellationToken) {
        let every = self.config.progress_interval;
        if every.is_zero() {
            return;
        }
        // The first line covers the time since start.
        let _ = self.tally.take();
        loop {
            tokio::select! {
                () = tokio::time::sleep(every) => {}
                () = shutdown.cancelled() => return,
            }
            let (published, duplicates) = self.tally.take();
            let interval = HumanDuration(every);
            let stats = tokio::select! {
                stats = tokio::time::timeout(STATS_TIMEOUT, self.store.stats(self.config.max_attempts)) => stats,
                () = shutdown.cancelled() => return,
            };
            match stats {
                Ok(Ok(stats)) => info!(
                    published,
                    duplicates,
                    backlog = stats.backlog,
                    past_cap = stats.past_cap,
                    oldest_unpublished = %HumanDuration(Duration::from_secs_f64(stats.oldest_age_secs.max(0.0))),
                    "relay progress over the last {interval}"
                ),
                Ok(Err(e)) => info!(
                    published,
                    duplicates,
                    backlog = "unknown",
                    error = %e,
                    "relay progress over the last {interval}"
                ),
                Err(_) => info!(
                    published,
                    duplicates,
                    backlog = "unknown",
                    error = %format!("the database did not answer within {}", HumanDuration(STATS_TIMEOUT)),
                    "relay progress over the last {interval}"
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::{FailureKind, PublishFailure};

    fn row() -> ClaimedRow {
        ClaimedRow::sample()
    }

    #[test]
    fn only_published_rows_count_and_a_take_starts_again() {
        let tally = Tally::default();
        tally.count(&[
            (
                row(),
                Outcome::Published {
                    duplicate: false,
                    position: None,
                },
            ),
            (
                row(),
                Outcome::Published {
                    duplicate: true,
                    position: None,
                },
            ),
            (
                row(),
                Outcome::Failed(PublishFailure::new(FailureKind::Timeout, "x")),
            ),
            (row(), Outcome::Unresolved),
        ]);
        assert_eq!(tally.take(), (2, 1));
        assert_eq!(tally.take(), (0, 0));
    }
}
