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
//! slow or failed request leaves the gauges at their last values. The first
//! failure after a success is a warning (the lag alerts then judge a stale
//! number), later ones are logged at debug level, and the first success
//! after them at info.

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
    let mut failing = false;
    loop {
        ticks.tick().await;
        let error = match tokio::time::timeout(LAG_TIMEOUT, consumer.get_info()).await {
            Ok(Ok(info)) => {
                metrics::gauge!(names::PENDING, &labels).set(info.num_pending as f64);
                metrics::gauge!(names::ACK_PENDING, &labels).set(info.num_ack_pending as f64);
                if std::mem::take(&mut failing) {
                    tracing::info!(consumer = %labels[0].1, "reading the consumer's lag again");
                }
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {LAG_TIMEOUT:?}"),
        };
        if std::mem::replace(&mut failing, true) {
            tracing::debug!(consumer = %labels[0].1, %error, "reading the consumer's lag failed");
        } else {
            tracing::warn!(
                consumer = %labels[0].1, %error,
                "reading the consumer's lag failed; its gauges keep their last values until it succeeds",
            );
        }
    }
}
