//! The consumer's lag, from JetStream's view of the durable: every
//! [`LAG_INTERVAL`] the runtime asks for the consumer's info (bounded by
//! [`LAG_TIMEOUT`]) and sets, labelled `consumer` and `stream`,
//!
//! - `inbox_pending_messages`: messages of the stream matching the
//!   durable's filter not yet delivered (`num_pending`);
//! - `inbox_ack_pending_messages`: delivered, not yet acked
//!   (`num_ack_pending`).
//!
//! The same read is kept for the runtime's other tasks
//! ([`Shared::info`](super::process::Shared)), and records the durable's ack floor in `inbox_consumers`
//! ([`position`](super::position)), where a durable created again starts;
//! while messages are being settled the read comes sooner (at most every
//! 100 ms), and [`record_floor`] records it once more when the runtime stops.
//!
//! It runs on a task of its own beside message handling, never in its way: a
//! slow or failed request leaves the gauges at their last values. The first
//! failure after a success is a warning (the lag alerts then judge a stale
//! number), later ones are logged at debug level, and the first success
//! after them at info.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;

use super::position;
use super::process::Shared;
use crate::metrics::names;

/// How often the lag is read.
pub const LAG_INTERVAL: Duration = Duration::from_secs(1);

/// The least time between two reads when messages are being settled: the
/// recorded ack floor trails the acks by about this much under load, by
/// [`LAG_INTERVAL`] at most.
const FLOOR_SPACING: Duration = Duration::from_millis(100);

/// The longest time between two writes of the consumer's row while it runs:
/// a row silent for 30 s belongs to a consumer no runtime runs any more.
const HEARTBEAT: Duration = Duration::from_secs(5);

/// Bound on one consumer-info request.
pub const LAG_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads the durable's lag every [`LAG_INTERVAL`] until dropped, and records
/// its ack floor when it rose.
pub(super) async fn poll(consumer: PullConsumer, shared: Arc<Shared>) {
    let config = &shared.config;
    let labels = [
        ("consumer", config.durable.clone()),
        ("stream", config.stream.clone()),
    ];
    let mut ticks = tokio::time::interval(LAG_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    let mut recorded = None;
    let mut last_read = tokio::time::Instant::now();
    let mut written = last_read;
    let mut unrecorded = false;
    loop {
        // Every interval, and soon after messages were settled (at most every
        // FLOOR_SPACING), so the recorded floor trails the acks by little.
        tokio::select! {
            _ = ticks.tick() => {}
            () = shared.settled.notified() => {
                tokio::time::sleep_until(last_read + FLOOR_SPACING).await;
            }
        }
        last_read = tokio::time::Instant::now();
        let error = match tokio::time::timeout(LAG_TIMEOUT, consumer.get_info()).await {
            Ok(Ok(info)) => {
                shared.info.send_replace(Some(info.clone()));
                metrics::gauge!(names::PENDING, &labels).set(info.num_pending as f64);
                metrics::gauge!(names::ACK_PENDING, &labels).set(info.num_ack_pending as f64);
                let floor = info.ack_floor.stream_sequence;
                if recorded != Some(floor) || written.elapsed() >= HEARTBEAT {
                    match position::record(&shared.pool, config, floor).await {
                        Ok(()) => {
                            recorded = Some(floor);
                            written = tokio::time::Instant::now();
                            unrecorded = false;
                        }
                        // A warning once, the repeats at debug: the lag
                        // reads go on, and the next write catches up.
                        Err(e) if !std::mem::replace(&mut unrecorded, true) => tracing::warn!(
                            consumer = %labels[0].1, error = %e,
                            "recording the consumer's ack floor failed; tried again next time",
                        ),
                        Err(e) => tracing::debug!(
                            consumer = %labels[0].1, error = %e,
                            "recording the consumer's ack floor failed again",
                        ),
                    }
                }
                if std::mem::take(&mut failing) {
                    tracing::info!(consumer = %labels[0].1, "reading the consumer's lag again");
                }
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {}", outbox_pg::HumanDuration(LAG_TIMEOUT)),
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

/// Reads the durable's ack floor once (bounded by [`LAG_TIMEOUT`]) and records
/// it: the runtime's last word on where it stands, after a drain.
pub(super) async fn record_floor(consumer: &PullConsumer, shared: &Shared) {
    let config = &shared.config;
    let recorded = async {
        let info = tokio::time::timeout(LAG_TIMEOUT, consumer.get_info())
            .await
            .map_err(|_| format!("no answer within {}", outbox_pg::HumanDuration(LAG_TIMEOUT)))?
            .map_err(|e| e.to_string())?;
        position::record(&shared.pool, config, info.ack_floor.stream_sequence)
            .await
            .map_err(|e| e.to_string())?;
        position::stopped(&shared.pool, &config.durable)
            .await
            .map_err(|e| e.to_string())
    };
    if let Err(error) = recorded.await {
        tracing::warn!(
            consumer = %config.durable, %error,
            "could not record the ack floor at stop; the floor recorded while running stands",
        );
    }
}
