//! The consumer's lag, from JetStream's view of the durable: every
//! [`LAG_INTERVAL`] the runtime asks for the consumer's info (bounded by
//! [`LAG_TIMEOUT`]) and sets, labelled `consumer` and `stream`,
//!
//! - `inbox_consumer_pending_messages`: messages of the stream matching the
//!   durable's filter not yet delivered (`num_pending`);
//! - `inbox_consumer_ack_pending_messages`: delivered, not yet acked
//!   (`num_ack_pending`).
//!
//! It runs on a task of its own beside message handling, never in its way: a
//! slow or failed request leaves the gauges at their last values and is
//! logged at debug level.

use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;

use crate::metrics::names;

/// How often the lag is read.
pub const LAG_INTERVAL: Duration = Duration::from_secs(10);

/// Bound on one consumer-info request.
pub const LAG_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads the durable's lag every [`LAG_INTERVAL`] until dropped.
pub(super) async fn poll(consumer: PullConsumer, durable: String, stream: String) {
    let labels = [("consumer", durable), ("stream", stream)];
    let mut ticks = tokio::time::interval(LAG_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match tokio::time::timeout(LAG_TIMEOUT, consumer.get_info()).await {
            Ok(Ok(info)) => {
                metrics::gauge!(names::PENDING, &labels).set(info.num_pending as f64);
                metrics::gauge!(names::ACK_PENDING, &labels).set(info.num_ack_pending as f64);
            }
            Ok(Err(e)) => {
                tracing::debug!(consumer = %labels[0].1, error = %e, "reading the consumer's lag failed");
            }
            Err(_) => {
                tracing::debug!(consumer = %labels[0].1, "reading the consumer's lag timed out after {LAG_TIMEOUT:?}");
            }
        }
    }
}
