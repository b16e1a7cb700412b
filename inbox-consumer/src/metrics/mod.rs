//! Counters and a latency histogram per delivery, through the `metrics` crate.
//!
//! [`Metrics`] wraps a `Service<Delivery, Response = Outcome>` (or a batch
//! service, per delivery of the batch) and records,
//! labelled `consumer` and `event_type`:
//!
//! | name | kind | when |
//! | --- | --- | --- |
//! | `inbox_handled_total` | counter | the handler's effects committed |
//! | `inbox_stale_total` | counter | skipped as older than an applied event |
//! | `inbox_failed_total` | counter | the stack returned an error (rolled back) |
//! | `inbox_handler_duration_seconds` | histogram | every handled or failed delivery |
//!
//! Elsewhere: `inbox_duplicates_total` is counted by
//! [`Dedupe`](crate::dedupe::Dedupe) (so it is counted with or without this
//! layer), and `inbox_dead_lettered_total` (with a `reason` label) and
//! `inbox_unrouted_total` by the runtime, as is `inbox_replays_ignored_total`
//! (labelled `consumer`): replayed dead letters meant for another consumer of
//! the stream (their [`REPLAY_CONSUMER_HEADER`](crate::dead_letter::REPLAY_CONSUMER_HEADER)
//! names it), acked without being handled. `inbox_handler_panics_total`
//! (labelled `consumer` and `event_type`) counts the attempts whose handler,
//! or a layer, panicked: the runtime catches the panic, rolls the delivery
//! back and retries it, then dead-letters it (reason `panic`) once the
//! budget is spent (see [`runtime`](crate::runtime#a-panicking-handler)).
//! Such an attempt is not in `inbox_failed_total` nor in the duration
//! histogram: this layer's future never finished. The counter starts at zero
//! for each event type the durable is filtered to. The runtime also reports the
//! durable's lag, read from JetStream every
//! [`LAG_INTERVAL`](crate::runtime::LAG_INTERVAL) (1 s) on a task of its own,
//! as gauges labelled `consumer` and `stream`:
//!
//! | name | kind | what |
//! | --- | --- | --- |
//! | `inbox_pending_messages` | gauge | messages not yet delivered to the durable (`num_pending`) |
//! | `inbox_ack_pending_messages` | gauge | delivered, not yet acked (`num_ack_pending`) |
//!
//! Names follow the Prometheus conventions: counters end `_total`, units are
//! suffixes in plural base units, gauges carry no `_total`, every name starts
//! `inbox_`. Install any `metrics` recorder (for example
//! `metrics-exporter-prometheus`) to export them.

pub mod future;
mod layer;

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tower::Service;

use crate::delivery::{Deliveries, Delivery, Outcome};

pub use layer::MetricsLayer;

/// Metric names.
pub mod names {
    /// Counter: deliveries whose effects committed.
    pub const HANDLED: &str = "inbox_handled_total";
    /// Counter: deliveries skipped as stale.
    pub const STALE: &str = "inbox_stale_total";
    /// Counter: deliveries that failed and rolled back.
    pub const FAILED: &str = "inbox_failed_total";
    /// Counter: deliveries the inbox already held.
    pub const DUPLICATES: &str = "inbox_duplicates_total";
    /// Counter: messages dead-lettered (extra label `reason`).
    pub const DEAD_LETTERED: &str = "inbox_dead_lettered_total";
    /// Counter: messages of a type no route handles, acked without an effect.
    pub const UNROUTED: &str = "inbox_unrouted_total";
    /// Counter: replayed dead letters meant for another consumer, acked
    /// without being handled (label `consumer` only).
    pub const REPLAYS_IGNORED: &str = "inbox_replays_ignored_total";
    /// Counter: NATS clients found closed under the consumer (label
    /// `consumer` only); each ends [`Consumer::run`](crate::Consumer::run)
    /// with [`ErrorKind::ClientClosed`](crate::ErrorKind::ClientClosed).
    pub const CLIENT_CLOSED: &str = "inbox_nats_client_closed_total";
    /// Counter: attempts of a delivery whose handler (or a layer) panicked,
    /// caught by the runtime and rolled back (see
    /// [`runtime`](crate::runtime#a-panicking-handler)).
    pub const HANDLER_PANICS: &str = "inbox_handler_panics_total";
    /// Histogram: seconds from the start of a delivery's handling to its commit or failure.
    pub const HANDLER_DURATION: &str = "inbox_handler_duration_seconds";
    /// Gauge: messages not yet delivered to the durable (labels `consumer`, `stream`).
    pub const PENDING: &str = "inbox_pending_messages";
    /// Gauge: messages delivered and not yet acked (labels `consumer`, `stream`).
    pub const ACK_PENDING: &str = "inbox_ack_pending_messages";

    /// Every metric name the consumer records.
    pub const ALL: &[&str] = &[
        HANDLED,
        STALE,
        FAILED,
        DUPLICATES,
        DEAD_LETTERED,
        UNROUTED,
        REPLAYS_IGNORED,
        CLIENT_CLOSED,
        HANDLER_PANICS,
        HANDLER_DURATION,
        PENDING,
        ACK_PENDING,
    ];
}

/// Registers descriptions and units of the metrics above with the installed
/// recorder. Call once after installing it; recording works without this.
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(names::HANDLED, "Deliveries whose effects committed");
    describe_counter!(
        names::STALE,
        "Deliveries skipped as older than an applied event of their subject"
    );
    describe_counter!(names::FAILED, "Deliveries that failed and rolled back");
    describe_counter!(
        names::DUPLICATES,
        "Deliveries of events the inbox already held (skipped)"
    );
    describe_counter!(names::DEAD_LETTERED, "Messages dead-lettered, by reason");
    describe_counter!(
        names::UNROUTED,
        "Messages of an event type no route handles, acked without an effect"
    );
    describe_counter!(
        names::REPLAYS_IGNORED,
        "Replayed dead letters meant for another consumer, acked without being handled"
    );
    describe_counter!(
        names::CLIENT_CLOSED,
        "NATS clients found closed under the consumer (the run ends; a new client is needed)"
    );
    describe_counter!(
        names::HANDLER_PANICS,
        "Delivery attempts whose handler panicked (caught, rolled back, retried or dead-lettered)"
    );
    describe_histogram!(
        names::HANDLER_DURATION,
        Unit::Seconds,
        "From the start of a delivery's handling to its commit or failure"
    );
    describe_gauge!(
        names::PENDING,
        Unit::Count,
        "Messages of the stream not yet delivered to the durable consumer"
    );
    describe_gauge!(
        names::ACK_PENDING,
        Unit::Count,
        "Messages delivered to the durable consumer and not yet acked"
    );
}

/// The metadata of every series recorded here, as `metrics::counter!` in
/// this module would give it.
const METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// Most (consumer, event type) pairs whose keys one [`Metrics`] keeps; past
/// that, keys are built per delivery.
const KEPT: usize = 64;

/// The keys of one consumer's and event type's series, built once: a
/// [`metrics::Key`] hashes its name and labels when it is made, so recording
/// through it is one lookup, without building labels per delivery.
#[derive(Debug)]
pub(crate) struct Keys {
    consumer: String,
    event_type: String,
    handled: metrics::Key,
    stale: metrics::Key,
    failed: metrics::Key,
    duration: metrics::Key,
}

impl Keys {
    /// The keys of `delivery`'s series, labelled `consumer` and `event_type`.
    fn new(delivery: &Delivery) -> Self {
        let (consumer, event_type) = (delivery.consumer(), delivery.event_type().as_str());
        let key = |name: &'static str| {
            metrics::Key::from_parts(
                name,
                vec![
                    metrics::Label::new("consumer", consumer.to_owned()),
                    metrics::Label::new("event_type", event_type.to_owned()),
                ],
            )
        };
        Self {
            consumer: consumer.to_owned(),
            event_type: event_type.to_owned(),
            handled: key(names::HANDLED),
            stale: key(names::STALE),
            failed: key(names::FAILED),
            duration: key(names::HANDLER_DURATION),
        }
    }

    fn fits(&self, delivery: &Delivery) -> bool {
        self.event_type == delivery.event_type().as_str() && self.consumer == delivery.consumer()
    }
}

/// Counts one delivery's result (`None`: failed) and, unless it was a
/// duplicate, its latency, with the recorder installed when it is called
/// (as `metrics::counter!` would).
fn record(keys: &Keys, outcome: Option<&Outcome>, seconds: f64) {
    let counter = match outcome {
        Some(Outcome::Handled) => &keys.handled,
        Some(Outcome::Stale) => &keys.stale,
        Some(Outcome::Duplicate) => return,
        None => &keys.failed,
    };
    metrics::with_recorder(|recorder| {
        recorder.register_counter(counter, &METADATA).increment(1);
        recorder
            .register_histogram(&keys.duration, &METADATA)
            .record(seconds);
    });
}

/// Records counts and latency of the inner service. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Metrics<S> {
    inner: S,
    /// The keys of the (consumer, event type) pairs seen, at most [`KEPT`].
    keys: Vec<Arc<Keys>>,
}

impl<S> Metrics<S> {
    /// Wraps `inner`.
    pub const fn new(inner: S) -> Self {
        Self {
            inner,
            keys: Vec::new(),
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The keys of `delivery`'s series, kept for the next delivery of its
    /// consumer and event type.
    fn keys(&mut self, delivery: &Delivery) -> Arc<Keys> {
        if let Some(keys) = self.keys.iter().find(|k| k.fits(delivery)) {
            return Arc::clone(keys);
        }
        let keys = Arc::new(Keys::new(delivery));
        if self.keys.len() < KEPT {
            self.keys.push(Arc::clone(&keys));
        }
        keys
    }
}

impl<S, R> Service<R> for Metrics<S>
where
    R: Deliveries,
    S: Service<R, Response = R::Response>,
{
    type Response = R::Response;
    type Error = S::Error;
    type Future = future::ResponseFuture<S::Future, R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let keys = request
            .deliveries()
            .iter()
            .map(|delivery| self.keys(delivery))
            .collect();
        future::ResponseFuture::new(self.inner.call(request), Instant::now(), keys)
    }
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use outbox_pg::Envelope;
    use tower::Layer;
    use tower_test::mock;

    use super::*;
    use crate::delivery::{BatchResults, DeliveryInfo};

    /// Counter increments and histogram samples by name, read once (a
    /// snapshot drains them), every series labelled by consumer and event
    /// type.
    fn counts(snapshotter: &Snapshotter) -> std::collections::HashMap<String, u64> {
        let mut counts = std::collections::HashMap::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let labels: Vec<_> = key.key().labels().map(|l| l.key().to_owned()).collect();
            assert_eq!(labels, ["consumer", "event_type"], "{key:?}");
            let n = match value {
                DebugValue::Counter(n) => n,
                DebugValue::Histogram(samples) => samples.len() as u64,
                DebugValue::Gauge(_) => 0,
            };
            *counts.entry(key.key().name().to_owned()).or_default() += n;
        }
        counts
    }

    fn delivery() -> Delivery {
        let env = Envelope::new("a.b", "svc", "s1", serde_json::json!({})).unwrap();
        Delivery::new(env, DeliveryInfo::new("c1"))
    }

    #[test]
    fn counts_outcomes_and_failures_with_latency() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            futures::executor::block_on(async {
                let (inner, mut handle) = mock::pair::<Delivery, Outcome>();
                let mut svc = MetricsLayer::new().layer(inner);
                handle.allow(4);
                for respond in [
                    Ok(Outcome::Handled),
                    Ok(Outcome::Duplicate),
                    Ok(Outcome::Stale),
                    Err("boom"),
                ] {
                    std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
                    let fut = svc.call(delivery());
                    let (request, send) = handle.next_request().await.unwrap();
                    assert_eq!(request.consumer(), "c1");
                    match respond {
                        Ok(outcome) => {
                            send.send_response(outcome);
                            assert_eq!(fut.await.unwrap(), outcome);
                        }
                        Err(e) => {
                            send.send_error(e);
                            assert_eq!(fut.await.unwrap_err().to_string(), "boom");
                        }
                    }
                }
            });
        });
        let counts = counts(&snapshotter);
        let count = |name: &str| counts.get(name).copied().unwrap_or(0);
        assert_eq!(count(names::HANDLED), 1);
        assert_eq!(count(names::STALE), 1);
        assert_eq!(count(names::FAILED), 1);
        // Duplicates are counted by the dedupe layer, not here.
        assert_eq!(count(names::DUPLICATES), 0);
        assert_eq!(count(names::HANDLER_DURATION), 3);
    }

    #[test]
    fn a_batch_is_counted_per_delivery_by_its_own_result() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            futures::executor::block_on(async {
                let (inner, mut handle) = mock::pair::<Vec<Delivery>, BatchResults>();
                let mut svc = MetricsLayer::new().layer(inner);
                handle.allow(2);
                std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
                let fut = svc.call(vec![delivery(), delivery(), delivery()]);
                let (_, send) = handle.next_request().await.unwrap();
                send.send_response(vec![
                    Ok(Outcome::Handled),
                    Err("bad row".into()),
                    Ok(Outcome::Stale),
                ]);
                assert_eq!(fut.await.unwrap().len(), 3);
                // A batch failing as a whole fails each of its deliveries.
                std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
                let fut = svc.call(vec![delivery(), delivery()]);
                let (_, send) = handle.next_request().await.unwrap();
                send.send_error("down");
                assert!(fut.await.is_err());
            });
        });
        let counts = counts(&snapshotter);
        let count = |name: &str| counts.get(name).copied().unwrap_or(0);
        assert_eq!(count(names::HANDLED), 1);
        assert_eq!(count(names::STALE), 1);
        assert_eq!(count(names::FAILED), 3);
    }

    #[test]
    fn each_consumer_and_event_type_keeps_its_own_series() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let of = |event_type: &str, consumer: &str| {
            let env = Envelope::new(event_type, "svc", "s1", serde_json::json!({})).unwrap();
            Delivery::new(env, DeliveryInfo::new(consumer))
        };
        metrics::with_local_recorder(&recorder, || {
            futures::executor::block_on(async {
                let (inner, mut handle) = mock::pair::<Vec<Delivery>, BatchResults>();
                let mut svc = MetricsLayer::new().layer(inner);
                handle.allow(2);
                for _ in 0..2 {
                    std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
                    let batch = vec![of("a.b", "c1"), of("a.c", "c1"), of("a.b", "c2")];
                    let fut = svc.call(batch);
                    let (_, send) = handle.next_request().await.unwrap();
                    send.send_response((0..3).map(|_| Ok(Outcome::Handled)).collect());
                    fut.await.unwrap();
                }
            });
        });
        let mut handled: Vec<(String, u64)> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(key, ..)| key.key().name() == names::HANDLED)
            .map(|(key, _, _, value)| {
                let labels: Vec<String> = key
                    .key()
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                let DebugValue::Counter(n) = value else {
                    panic!("{key:?} is not a counter")
                };
                (labels.join(","), n)
            })
            .collect();
        handled.sort();
        assert_eq!(
            handled,
            [
                ("consumer=c1,event_type=a.b".to_owned(), 2),
                ("consumer=c1,event_type=a.c".to_owned(), 2),
                ("consumer=c2,event_type=a.b".to_owned(), 2),
            ]
        );
    }
}
