//! Inbox retention: batched pruning, and a start-up check that the window
//! outlasts redelivery.
//!
//! An inbox row only has to live as long as a duplicate of its event can still
//! arrive. Deleting it earlier turns a late redelivery into a second effect, so
//! the runtime refuses to start when [`Retention::window`] is shorter than the
//! consumer's redelivery window ([`redelivery_window`]: every gap between
//! deliveries up to `max_deliver`, each the larger of the ack wait (or its
//! backoff step) and the runtime's nak delay). A consumer with unlimited
//! deliveries has no bound; that is logged as a warning.
//!
//! The window must also cover the publisher side (the relay republishing after a
//! lost mark, a replay of the stream): keep the default 14 days unless you know
//! both. Pruning deletes rows of one consumer in batches with `FOR UPDATE SKIP
//! LOCKED`, so it never waits on a handler's transaction.
//!
//! # Dead letters
//!
//! `inbox_dead_letters` is bounded the same way, on a longer window
//! ([`DEFAULT_DEAD_LETTER_WINDOW`], 30 days: a dead letter is evidence someone
//! has to look at, and nothing deduplicates against it once its message is
//! terminated). The runtime prunes a consumer's dead letters on the inbox's
//! interval ([`Retention::dead_letter_window`]; `None` keeps them);
//! [`prune_dead_letters`] does the same for one consumer or all of them, for
//! a tool or a scheduled job.

use std::time::Duration;

use sqlx::PgPool;

use crate::error::{Error, ErrorKind};
use crate::retry::RetryPolicy;

/// The default retention window: 14 days.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(14 * 24 * 60 * 60);

/// The default dead-letter retention window: 30 days.
pub const DEFAULT_DEAD_LETTER_WINDOW: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// Rows deleted per statement by default.
const DEFAULT_BATCH: u32 = 1_000;

/// How long inbox rows and dead letters are kept, and how pruning runs.
#[derive(Debug, Clone)]
pub struct Retention {
    window: Duration,
    dead_letter_window: Option<Duration>,
    batch_size: u32,
    interval: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            dead_letter_window: Some(DEFAULT_DEAD_LETTER_WINDOW),
            batch_size: DEFAULT_BATCH,
            interval: Duration::from_secs(60 * 60),
        }
    }
}

impl Retention {
    /// Rows handled longer ago than this are pruned. Default: 14 days.
    #[must_use]
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// Dead letters recorded longer ago than this are pruned, on the same
    /// interval as the inbox; `None` keeps them for ever. Default: 30 days.
    #[must_use]
    pub fn dead_letter_window(mut self, window: Option<Duration>) -> Self {
        self.dead_letter_window = window;
        self
    }

    /// Rows deleted per statement. Default: 1,000.
    #[must_use]
    pub fn batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// How often the runtime prunes. Default: hourly.
    #[must_use]
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// The window.
    pub fn get_window(&self) -> Duration {
        self.window
    }

    /// The pruning interval.
    pub fn get_interval(&self) -> Duration {
        self.interval
    }

    /// The dead-letter window, if dead letters are pruned.
    pub fn get_dead_letter_window(&self) -> Option<Duration> {
        self.dead_letter_window
    }

    /// Deletes `consumer`'s dead letters older than the dead-letter window,
    /// batch by batch; returns how many. Nothing when the window is `None`.
    ///
    /// # Errors
    /// As [`prune_dead_letters`].
    pub async fn prune_dead_letters(&self, pool: &PgPool, consumer: &str) -> Result<u64, Error> {
        match self.dead_letter_window {
            Some(window) => {
                prune_dead_letters_in_batches(pool, Some(consumer), window, self.batch_size).await
            }
            None => Ok(0),
        }
    }

    /// Deletes `consumer`'s inbox rows older than the window, batch by batch,
    /// until a batch comes back short. Returns how many rows were deleted.
    ///
    /// # Errors
    /// [`ErrorKind::Database`] if a delete fails (earlier batches stay deleted);
    /// [`ErrorKind::Config`] if the window is too large to subtract from now.
    pub async fn prune(&self, pool: &PgPool, consumer: &str) -> Result<u64, Error> {
        let cutoff = cutoff(self.window)?;
        let mut total = 0;
        loop {
            let deleted = sqlx::query_file!(
                "queries/prune_inbox.sql",
                consumer,
                cutoff,
                i64::from(self.batch_size),
            )
            .execute(pool)
            .await
            .map_err(|e| Error::database("pruning inbox_events", e))?
            .rows_affected();
            total += deleted;
            if deleted < u64::from(self.batch_size) {
                return Ok(total);
            }
        }
    }
}

/// `now - window`, as a timestamp.
fn cutoff(window: Duration) -> Result<chrono::DateTime<chrono::Utc>, Error> {
    let span = chrono::Duration::from_std(window).map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!(
                "retention window {} is out of range",
                outbox_pg::HumanDuration(window)
            ),
        )
        .with_source(e)
    })?;
    chrono::Utc::now().checked_sub_signed(span).ok_or_else(|| {
        Error::new(
            ErrorKind::Config,
            "retention window reaches before the epoch",
        )
    })
}

/// Deletes dead letters recorded more than `older_than` ago, of `consumer`
/// or, with `None`, of every consumer: 1,000 rows per statement, each
/// skipping rows another transaction holds (`FOR UPDATE SKIP LOCKED`), until
/// a batch comes back short. Returns how many rows were deleted.
///
/// This is what the runtime runs on its retention interval
/// ([`Retention::dead_letter_window`]), for a tool or a scheduled job:
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let pool = sqlx::PgPool::connect("postgres://localhost/billing").await?;
/// use std::time::Duration;
/// let deleted = inbox_consumer::retention::prune_dead_letters(
///     &pool,
///     Some("billing"),
///     Duration::from_secs(90 * 24 * 60 * 60),
/// )
/// .await?;
/// # let _ = deleted; Ok(()) }
/// ```
///
/// # Errors
/// [`ErrorKind::Database`] if a delete fails (earlier batches stay deleted);
/// [`ErrorKind::Privilege`] if the role may not delete from
/// `inbox_dead_letters`; [`ErrorKind::Config`] if `older_than` is too large
/// to subtract from now.
pub async fn prune_dead_letters(
    pool: &PgPool,
    consumer: Option<&str>,
    older_than: Duration,
) -> Result<u64, Error> {
    prune_dead_letters_in_batches(pool, consumer, older_than, DEFAULT_BATCH).await
}

async fn prune_dead_letters_in_batches(
    pool: &PgPool,
    consumer: Option<&str>,
    older_than: Duration,
    batch_size: u32,
) -> Result<u64, Error> {
    let cutoff = cutoff(older_than)?;
    let mut total = 0;
    loop {
        let deleted = sqlx::query_file!(
            "queries/prune_dead_letters.sql",
            consumer,
            cutoff,
            i64::from(batch_size),
        )
        .execute(pool)
        .await
        .map_err(|e| Error::database("pruning inbox_dead_letters", e))?
        .rows_affected();
        total += deleted;
        if deleted < u64::from(batch_size) {
            return Ok(total);
        }
    }
}

/// The longest a message can keep being redelivered: the sum, over the gaps
/// between `max_deliver` deliveries, of the larger of the ack-wait gap (the
/// `backoff` step if any, else `ack_wait`) and `retry`'s nak delay, plus one
/// last ack wait. `None` when deliveries are unlimited (`max_deliver` ≤ 0).
pub fn redelivery_window(
    ack_wait: Duration,
    max_deliver: i64,
    backoff: &[Duration],
    retry: &RetryPolicy,
) -> Option<Duration> {
    let max_deliver = u64::try_from(max_deliver).ok().filter(|n| *n > 0)?;
    let mut total = ack_wait;
    for delivered in 1..max_deliver {
        let index = usize::try_from(delivered - 1).unwrap_or(usize::MAX);
        let ack_gap = match backoff {
            [] => ack_wait,
            steps => steps
                .get(index)
                .or(steps.last())
                .copied()
                .unwrap_or(ack_wait),
        };
        total = total.saturating_add(ack_gap.max(retry.delay(delivered)));
    }
    Some(total)
}

/// Checks a retention window against a redelivery window.
///
/// # Errors
/// [`ErrorKind::Config`] when `window` is shorter than `redelivery`, naming both.
/// An unbounded redelivery (`None`) is allowed, with a warning.
pub fn check_window(window: Duration, redelivery: Option<Duration>) -> Result<(), Error> {
    match redelivery {
        None => {
            tracing::warn!(
                retention = ?window,
                "the consumer redelivers without limit (max_deliver unset): a duplicate arriving \
                 after the inbox retention window would be handled again; set max_deliver",
            );
            Ok(())
        }
        Some(redelivery) if window < redelivery => Err(Error::new(
            ErrorKind::Config,
            format!(
                "inbox retention window {} is shorter than the consumer's redelivery \
                 window {} (max_deliver × ack_wait/backoff and nak delays): a late \
                 redelivery would find its inbox row pruned and be handled twice; lengthen the \
                 window or lower max_deliver/ack_wait",
                outbox_pg::HumanDuration(window),
                outbox_pg::HumanDuration(redelivery),
            ),
        )),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_nak_delay() -> RetryPolicy {
        RetryPolicy::default()
            .base(Duration::ZERO)
            .max(Duration::ZERO)
    }

    #[test]
    fn window_is_max_deliver_times_ack_wait_without_backoff() {
        let w = redelivery_window(Duration::from_secs(30), 5, &[], &no_nak_delay());
        assert_eq!(w, Some(Duration::from_secs(150)));
    }

    #[test]
    fn backoff_steps_repeat_the_last_one() {
        let steps = [Duration::from_secs(1), Duration::from_secs(10)];
        let w = redelivery_window(Duration::from_secs(30), 4, &steps, &no_nak_delay());
        // first ack wait + 1 + 10 + 10
        assert_eq!(w, Some(Duration::from_secs(51)));
    }

    #[test]
    fn nak_delays_count_when_longer() {
        let retry = RetryPolicy::default()
            .base(Duration::from_secs(60))
            .max(Duration::from_secs(60));
        let w = redelivery_window(Duration::from_secs(1), 3, &[], &retry);
        assert_eq!(w, Some(Duration::from_secs(121)));
    }

    #[test]
    fn unlimited_deliveries_have_no_window() {
        assert_eq!(
            redelivery_window(Duration::from_secs(1), -1, &[], &no_nak_delay()),
            None
        );
        assert!(check_window(Duration::from_secs(1), None).is_ok());
    }

    #[test]
    fn a_short_window_is_refused_with_both_numbers() {
        let err =
            check_window(Duration::from_secs(60), Some(Duration::from_secs(300))).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("window 1m is shorter"), "{err}");
        assert!(err.to_string().contains("window 5m (max_deliver"), "{err}");
        assert!(check_window(DEFAULT_WINDOW, Some(Duration::from_secs(300))).is_ok());
    }
}
