//! A `tracing` span per delivery, carrying the publisher's trace context.
//!
//! [`Trace`] opens an `inbox.delivery` span with `consumer`, `event_id`,
//! `event_type`, `subject`, `stream_sequence` and `delivered`, and records
//! `outcome` (or `error`) when the delivery finishes. The span is entered only
//! while the inner future is polled (the `Instrumented` pattern), never held
//! across an `.await`.
//!
//! When the message carries a W3C `traceparent` (header, else the envelope's
//! extension attribute), the span records it as `traceparent`, and its parts as
//! `trace_id` and `parent_span_id`, so log search can join a delivery to the
//! writer's trace on `trace_id`.
//!
//! # OpenTelemetry
//!
//! With the `opentelemetry` feature, the span's OpenTelemetry parent is also
//! set from that `traceparent` and `tracestate`
//! (`tracing_opentelemetry::OpenTelemetrySpanExt::set_parent`, the W3C
//! propagator of `outbox_pg::trace_context`): the delivery span is a
//! **child** of the writer's span, and the handler's own spans are children of
//! the delivery span, so one trace runs from the write through the relay to
//! every handler. The messaging semantic conventions also allow a *link*
//! instead (the consumer starting a trace of its own that points at the
//! producer's); a child is chosen here because a transactional outbox hands
//! each event to each consumer once per delivery, so the trace stays the
//! size of its fan-out, and a trace view shows the write and its effects
//! together. A redelivery is another child of the same writer span. Without an
//! OpenTelemetry layer in the subscriber, or for a message without a valid
//! `traceparent`, the span keeps its ordinary parent.
//!
//! [`Trace`] serves one [`Delivery`] and a batch, `Vec<Delivery>`
//! ([`Consumer::run_batched`](crate::Consumer::run_batched)): each is a
//! [`Deliveries`](crate::Deliveries), whose results close the spans.
//!
//! In batch mode (`Service<Vec<Delivery>>`) each delivery gets its own
//! `inbox.delivery` span, made a child of its own writer's span as above and
//! entered while its handler runs ([`HandlerService`](crate::HandlerService)
//! instruments the handler with it); the `inbox.batch` span around them is
//! linked to each writer's span.

pub mod future;
mod layer;

use std::task::{Context, Poll};

use tower::Service;
use tracing::field::Empty;

use crate::delivery::{BatchResults, Delivery, Outcome};

pub use layer::TraceLayer;

/// The parts of a W3C `traceparent` (`version-traceid-parentid-flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent<'a> {
    /// 32 lowercase hex digits.
    pub trace_id: &'a str,
    /// 16 lowercase hex digits: the publisher's span.
    pub parent_span_id: &'a str,
    /// Whether the publisher sampled the trace.
    pub sampled: bool,
}

impl<'a> TraceParent<'a> {
    /// Parses a `traceparent` header value; `None` if it is malformed or all-zero.
    pub fn parse(value: &'a str) -> Option<Self> {
        let mut parts = value.trim().split('-');
        let (version, trace_id, parent, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            s.len() == len
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        if !hex(version, 2)
            || version == "ff"
            || !hex(trace_id, 32)
            || !hex(parent, 16)
            || !hex(flags, 2)
        {
            return None;
        }
        if version == "00" && parts.next().is_some() {
            return None;
        }
        if trace_id.bytes().all(|b| b == b'0') || parent.bytes().all(|b| b == b'0') {
            return None;
        }
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(Self {
            trace_id,
            parent_span_id: parent,
            sampled: flags & 1 == 1,
        })
    }
}

/// Instruments the inner service with a span per delivery. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct Trace<S> {
    inner: S,
}

impl<S> Trace<S> {
    /// Wraps `inner`.
    pub const fn new(inner: S) -> Self {
        Self { inner }
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
}

/// The span of one delivery (with the `opentelemetry` feature, a child of
/// the writer's span; see the [module docs](self)).
pub fn delivery_span(delivery: &Delivery) -> tracing::Span {
    // Every field known at the start is given here, none recorded after:
    // each later `record` is another lookup of the span and another pass of
    // every layer. `None` records nothing, as an `Empty` field never recorded.
    let traceparent = delivery.traceparent();
    let parsed = traceparent.and_then(TraceParent::parse);
    let span = tracing::info_span!(
        "inbox.delivery",
        consumer = delivery.consumer(),
        event_id = %delivery.id(),
        event_type = %delivery.event_type(),
        subject = delivery.subject(),
        stream_sequence = delivery.info().stream_sequence,
        delivered = delivery.info().delivered,
        traceparent = traceparent,
        trace_id = parsed.map(|p| p.trace_id),
        parent_span_id = parsed.map(|p| p.parent_span_id),
        tracestate = delivery.tracestate(),
        outcome = Empty,
        error = Empty,
    );
    #[cfg(feature = "opentelemetry")]
    if let Some(parent) = writer_context(delivery) {
        // Fails only without an OpenTelemetry layer, or for a disabled span:
        // then there is no trace to join.
        let _ = tracing_opentelemetry::OpenTelemetrySpanExt::set_parent(&span, parent);
    }
    span
}

/// The OpenTelemetry context of the span that wrote `delivery`'s event, from
/// its `traceparent` and `tracestate`; `None` without a valid `traceparent`.
#[cfg(feature = "opentelemetry")]
fn writer_context(delivery: &Delivery) -> Option<opentelemetry::Context> {
    outbox_pg::trace_context::remote_parent(delivery.traceparent()?, delivery.tracestate())
}

/// The `inbox.batch` span of a batch: the parent of its deliveries' spans,
/// and (with the `opentelemetry` feature) linked to each writer's span.
fn batch_span(deliveries: &[Delivery]) -> tracing::Span {
    let span = tracing::info_span!(
        "inbox.batch",
        consumer = deliveries.first().map(Delivery::consumer),
        deliveries = deliveries.len(),
    );
    #[cfg(feature = "opentelemetry")]
    for delivery in deliveries {
        if let Some(writer) = writer_context(delivery) {
            use opentelemetry::trace::TraceContextExt;
            tracing_opentelemetry::OpenTelemetrySpanExt::add_link(
                &span,
                writer.span().span_context().clone(),
            );
        }
    }
    span
}

/// One delivery: called and polled inside its own span.
impl<S> Service<Delivery> for Trace<S>
where
    S: Service<Delivery, Response = Outcome>,
    S::Error: std::fmt::Display,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = future::ResponseFuture<S::Future, Delivery>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, delivery: Delivery) -> Self::Future {
        let span = delivery_span(&delivery);
        let inner = {
            let _entered = span.enter();
            self.inner.call(delivery)
        };
        future::ResponseFuture::new(inner, span.clone(), vec![span])
    }
}

/// A batch: called and polled inside the `inbox.batch` span, each delivery
/// carrying its own span (a child of the batch's) down the stack, where its
/// handler runs in it.
impl<S> Service<Vec<Delivery>> for Trace<S>
where
    S: Service<Vec<Delivery>, Response = BatchResults>,
    S::Error: std::fmt::Display,
{
    type Response = BatchResults;
    type Error = S::Error;
    type Future = future::ResponseFuture<S::Future, Vec<Delivery>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, deliveries: Vec<Delivery>) -> Self::Future {
        let batch = batch_span(&deliveries);
        let (inner, spans) = {
            let _entered = batch.enter();
            let spans: Vec<tracing::Span> = deliveries.iter().map(delivery_span).collect();
            let deliveries = deliveries
                .into_iter()
                .zip(&spans)
                .map(|(delivery, span)| delivery.in_span(span.clone()))
                .collect();
            (self.inner.call(deliveries), spans)
        };
        future::ResponseFuture::new(inner, batch, spans)
    }
}

#[cfg(test)]
mod tests {
    use super::TraceParent;

    #[test]
    fn parses_w3c_traceparent() {
        let tp =
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(tp.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.parent_span_id, "00f067aa0ba902b7");
        assert!(tp.sampled);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        ] {
            assert!(TraceParent::parse(bad).is_none(), "{bad}");
        }
    }

    #[cfg(feature = "opentelemetry")]
    mod opentelemetry {
        use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
        use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
        use outbox_pg::Envelope;
        use serde_json::json;
        use tower::{Service, ServiceExt, service_fn};
        use tracing_subscriber::layer::SubscriberExt;

        use crate::delivery::{BatchResults, Delivery, DeliveryInfo, Outcome};
        use crate::error::BoxError;
        use crate::trace::Trace;

        const WRITER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
        const WRITER_SPAN: &str = "00f067aa0ba902b7";

        /// Spans exported to memory as they end, and the guard of the
        /// thread's subscriber that bridges them.
        fn otel() -> (
            InMemorySpanExporter,
            SdkTracerProvider,
            tracing::subscriber::DefaultGuard,
        ) {
            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder()
                .with_simple_exporter(exporter.clone())
                .build();
            let subscriber = tracing_subscriber::registry()
                .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("tests")));
            let guard = tracing::subscriber::set_default(subscriber);
            (exporter, provider, guard)
        }

        fn delivery(writer_span: &str, tracestate: Option<&str>) -> Delivery {
            let envelope = Envelope::new("a.b", "tests", "s-1", json!({})).unwrap();
            Delivery::new(envelope, DeliveryInfo::new("c")).with_trace_context(
                Some(format!("00-{WRITER_TRACE}-{writer_span}-01")),
                tracestate.map(str::to_owned),
            )
        }

        fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
            spans.iter().filter(|s| s.name == name).collect()
        }

        #[tokio::test]
        async fn the_delivery_span_is_a_child_of_the_writers_span_and_the_parent_of_the_handlers() {
            let (exporter, provider, _guard) = otel();
            let inner = service_fn(|_: Delivery| async {
                tracing::info_span!("handler").in_scope(|| {});
                Ok::<_, BoxError>(Outcome::Handled)
            });
            let outcome = Trace::new(inner)
                .oneshot(delivery(WRITER_SPAN, Some("rojo=1")))
                .await
                .unwrap();
            assert_eq!(outcome, Outcome::Handled);
            provider.force_flush().unwrap();

            let spans = exporter.get_finished_spans().unwrap();
            let (delivery, handler) = (named(&spans, "inbox.delivery"), named(&spans, "handler"));
            let (delivery, handler) = (delivery[0], handler[0]);
            let trace = TraceId::from_hex(WRITER_TRACE).unwrap();
            assert_eq!(delivery.span_context.trace_id(), trace);
            assert_eq!(
                delivery.parent_span_id,
                SpanId::from_hex(WRITER_SPAN).unwrap()
            );
            assert!(delivery.parent_span_is_remote);
            assert_eq!(delivery.span_context.trace_state().header(), "rojo=1");
            assert_eq!(handler.span_context.trace_id(), trace);
            assert_eq!(handler.parent_span_id, delivery.span_context.span_id());
        }

        #[tokio::test]
        async fn without_a_valid_traceparent_the_delivery_starts_a_trace_of_its_own() {
            let (exporter, provider, _guard) = otel();
            let inner = service_fn(|_: Delivery| async { Ok::<_, BoxError>(Outcome::Handled) });
            let bad = delivery(WRITER_SPAN, None)
                .with_trace_context(Some("00-not-a-traceparent".into()), None);
            Trace::new(inner).oneshot(bad).await.unwrap();
            provider.force_flush().unwrap();

            let spans = exporter.get_finished_spans().unwrap();
            let delivery = named(&spans, "inbox.delivery")[0];
            assert_ne!(
                delivery.span_context.trace_id(),
                TraceId::from_hex(WRITER_TRACE).unwrap()
            );
            assert_eq!(delivery.parent_span_id, SpanId::INVALID);
        }

        #[tokio::test]
        async fn in_a_batch_each_delivery_is_handled_in_its_own_writers_trace() {
            const OTHER_WRITER: &str = "00f067aa0ba902b8";
            let (exporter, provider, _guard) = otel();
            let inner = service_fn(|deliveries: Vec<Delivery>| async move {
                let results: BatchResults = deliveries
                    .iter()
                    .map(|d| {
                        // As HandlerService runs each handler in the delivery's span.
                        let span = d.span().cloned().unwrap_or_else(tracing::Span::none);
                        span.in_scope(|| tracing::info_span!("handler").in_scope(|| {}));
                        Ok(Outcome::Handled)
                    })
                    .collect();
                Ok::<_, BoxError>(results)
            });
            let mut trace = Trace::new(inner);
            let batch = vec![delivery(WRITER_SPAN, None), delivery(OTHER_WRITER, None)];
            let results = trace.ready().await.unwrap().call(batch).await.unwrap();
            assert_eq!(results.len(), 2);
            provider.force_flush().unwrap();

            let spans = exporter.get_finished_spans().unwrap();
            let deliveries = named(&spans, "inbox.delivery");
            let handlers = named(&spans, "handler");
            assert_eq!((deliveries.len(), handlers.len()), (2, 2));
            let writers = [WRITER_SPAN, OTHER_WRITER].map(|id| SpanId::from_hex(id).unwrap());
            for writer in writers {
                let delivery = deliveries
                    .iter()
                    .find(|d| d.parent_span_id == writer)
                    .unwrap();
                assert_eq!(
                    delivery.span_context.trace_id(),
                    TraceId::from_hex(WRITER_TRACE).unwrap()
                );
                assert!(
                    handlers
                        .iter()
                        .any(|h| h.parent_span_id == delivery.span_context.span_id())
                );
            }
            let batch = named(&spans, "inbox.batch")[0];
            let linked: Vec<SpanId> = batch
                .links
                .iter()
                .map(|l| l.span_context.span_id())
                .collect();
            assert_eq!(linked, writers);
        }
    }
}
