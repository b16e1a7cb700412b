//! W3C trace context to and from the OpenTelemetry context of `tracing`
//! spans (feature `opentelemetry`).
//!
//! An event carries its writer's trace context as the W3C `traceparent` and
//! `tracestate` values (columns of `outbox_events`, headers of the NATS
//! message, attributes of the envelope). This module converts between those
//! values and OpenTelemetry, through the SDK's W3C
//! [`TraceContextPropagator`] and the `tracing-opentelemetry` bridge:
//!
//! - [`TraceContext::current`] reads the context of the current `tracing`
//!   span, as a writer's side needs it: [`Outbox`](crate::Outbox) writes fill
//!   it in on events that carry none, and
//!   [`Envelope::with_current_trace_context`](crate::Envelope::with_current_trace_context)
//!   sets it explicitly.
//! - [`remote_parent`] turns received values back into a context a span can
//!   take as its parent (`tracing_opentelemetry::OpenTelemetrySpanExt::set_parent`),
//!   as the consumer's `Trace` layer does.
//!
//! Without an OpenTelemetry layer in the `tracing` subscriber spans have no
//! OpenTelemetry context: [`TraceContext::current`] is then `None`, and
//! nothing is written.

use std::collections::HashMap;

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::validate::{validate_traceparent, validate_tracestate};

/// Name of the W3C trace parent header (and envelope attribute).
const TRACEPARENT: &str = "traceparent";
/// Name of the W3C trace state header (and envelope attribute).
const TRACESTATE: &str = "tracestate";

/// A W3C trace context: a `traceparent` and, if any, a `tracestate`, both
/// valid as [`validate_traceparent`] and [`validate_tracestate`] require.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

impl TraceContext {
    /// The context of the current `tracing` span; `None` when it has no
    /// valid OpenTelemetry context (no OpenTelemetry layer installed, no span
    /// entered, or the span is disabled).
    pub fn current() -> Option<Self> {
        Self::of_span(&tracing::Span::current())
    }

    /// The context of `span`; `None` as for [`TraceContext::current`].
    pub fn of_span(span: &tracing::Span) -> Option<Self> {
        Self::of_context(&span.context())
    }

    /// The context of an OpenTelemetry [`Context`], written by the W3C
    /// propagator; `None` when its span context is not valid.
    ///
    /// A `tracestate` longer than
    /// [`MAX_TRACESTATE_LEN`](crate::MAX_TRACESTATE_LEN) or otherwise not
    /// publishable is left out (the `traceparent` alone still joins the
    /// trace), so the event can always be written.
    pub fn of_context(cx: &Context) -> Option<Self> {
        if !cx.span().span_context().is_valid() {
            return None;
        }
        let mut carrier = HashMap::with_capacity(2);
        TraceContextPropagator::new().inject_context(cx, &mut carrier);
        let traceparent = carrier.remove(TRACEPARENT)?;
        validate_traceparent(&traceparent).ok()?;
        let tracestate = carrier
            .remove(TRACESTATE)
            .filter(|ts| !ts.is_empty() && validate_tracestate(ts).is_ok());
        Some(Self {
            traceparent,
            tracestate,
        })
    }

    /// The `traceparent` value.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The `tracestate` value, if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The `traceparent` and `tracestate` values.
    pub fn into_parts(self) -> (String, Option<String>) {
        (self.traceparent, self.tracestate)
    }
}

/// The OpenTelemetry context of a remote span given by its W3C values, to be
/// the parent of a local span (read by the W3C propagator: a malformed
/// `tracestate` is dropped, the `traceparent` kept); `None` if `traceparent`
/// is malformed or all-zero.
pub fn remote_parent(traceparent: &str, tracestate: Option<&str>) -> Option<Context> {
    let carrier = Carrier {
        traceparent,
        tracestate,
    };
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

/// The two values, as the propagator reads them.
struct Carrier<'a> {
    traceparent: &'a str,
    tracestate: Option<&'a str>,
}

impl Extractor for Carrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        if key.eq_ignore_ascii_case(TRACEPARENT) {
            Some(self.traceparent)
        } else if key.eq_ignore_ascii_case(TRACESTATE) {
            self.tracestate
        } else {
            None
        }
    }

    fn keys(&self) -> Vec<&str> {
        match self.tracestate {
            Some(_) => vec![TRACEPARENT, TRACESTATE],
            None => vec![TRACEPARENT],
        }
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceFlags, TraceId, TraceState, TracerProvider as _,
    };
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    const TRACEPARENT_VALUE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// Runs `f` with a subscriber that bridges spans to OpenTelemetry.
    fn with_otel<R>(f: impl FnOnce() -> R) -> R {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("tests")));
        tracing::subscriber::with_default(subscriber, f)
    }

    #[test]
    fn the_current_span_gives_its_own_ids() {
        with_otel(|| {
            let span = tracing::info_span!("writer");
            let _entered = span.enter();
            let ids = span.context().span().span_context().clone();
            let tc = TraceContext::current().unwrap();
            assert_eq!(
                tc.traceparent(),
                format!("00-{}-{}-01", ids.trace_id(), ids.span_id())
            );
            assert_eq!(tc.tracestate(), None);
            validate_traceparent(tc.traceparent()).unwrap();
        });
    }

    #[test]
    fn no_layer_or_no_span_gives_none() {
        // No OpenTelemetry layer: spans have no context.
        let span = tracing::info_span!("writer");
        let _entered = span.enter();
        assert_eq!(TraceContext::current(), None);
        drop(_entered);
        // The layer, but no span entered.
        with_otel(|| assert_eq!(TraceContext::current(), None));
    }

    #[test]
    fn a_remote_parent_round_trips_with_its_state() {
        let cx = remote_parent(TRACEPARENT_VALUE, Some("rojo=00f067aa0ba902b7")).unwrap();
        let span_context = cx.span().span_context().clone();
        assert!(span_context.is_remote());
        assert_eq!(
            span_context.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(
            span_context.span_id(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap()
        );
        assert!(span_context.is_sampled());
        let back = TraceContext::of_context(&cx).unwrap();
        assert_eq!(back.traceparent(), TRACEPARENT_VALUE);
        assert_eq!(back.tracestate(), Some("rojo=00f067aa0ba902b7"));
    }

    #[test]
    fn a_child_of_a_remote_parent_is_in_its_trace() {
        with_otel(|| {
            let span = tracing::info_span!("handler");
            span.set_parent(remote_parent(TRACEPARENT_VALUE, None).unwrap())
                .unwrap();
            let child = span.context().span().span_context().clone();
            assert_eq!(
                child.trace_id(),
                TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
            );
            assert_ne!(
                child.span_id(),
                SpanId::from_hex("00f067aa0ba902b7").unwrap()
            );
        });
    }

    #[test]
    fn malformed_values_give_no_parent() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
        ] {
            assert!(remote_parent(bad, None).is_none(), "{bad}");
        }
        // A malformed state is dropped, the parent kept.
        let cx = remote_parent(TRACEPARENT_VALUE, Some("not a state")).unwrap();
        assert_eq!(TraceContext::of_context(&cx).unwrap().tracestate(), None);
    }

    #[test]
    fn an_unpublishable_state_is_left_out() {
        let long = (0..20)
            .map(|i| format!("k{i}=abcdefghijklmnopqrstuvwxy"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(long.len() > crate::MAX_TRACESTATE_LEN);
        let state: TraceState = long.parse().unwrap();
        let span_context = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            state,
        );
        let cx = Context::new().with_remote_span_context(span_context);
        let tc = TraceContext::of_context(&cx).unwrap();
        assert_eq!(tc.traceparent(), TRACEPARENT_VALUE);
        assert_eq!(tc.tracestate(), None);
        assert_eq!(TraceContext::of_context(&Context::new()), None);
    }
}
