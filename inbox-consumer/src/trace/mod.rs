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
//! `trace_id` and `parent_span_id`, so a subscriber can link the delivery to the
//! publisher's trace: an OpenTelemetry bridge can set the remote parent from
//! these fields, and log search can join on `trace_id` without one. This crate
//! deliberately does not depend on OpenTelemetry.

mod batch;
pub mod future;
mod layer;

use std::task::{Context, Poll};

use tower::Service;
use tracing::field::Empty;

use crate::delivery::{Delivery, Outcome};

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

/// The span of one delivery.
pub fn delivery_span(delivery: &Delivery) -> tracing::Span {
    let span = tracing::info_span!(
        "inbox.delivery",
        consumer = delivery.consumer(),
        event_id = %delivery.id(),
        event_type = %delivery.event_type(),
        subject = delivery.subject(),
        stream_sequence = delivery.info().stream_sequence,
        delivered = delivery.info().delivered,
        traceparent = Empty,
        tracestate = Empty,
        trace_id = Empty,
        parent_span_id = Empty,
        outcome = Empty,
        error = Empty,
    );
    if let Some(tp) = delivery.traceparent() {
        span.record("traceparent", tp);
        if let Some(parsed) = TraceParent::parse(tp) {
            span.record("trace_id", parsed.trace_id);
            span.record("parent_span_id", parsed.parent_span_id);
        }
    }
    if let Some(ts) = delivery.tracestate() {
        span.record("tracestate", ts);
    }
    span
}

impl<S> Service<Delivery> for Trace<S>
where
    S: Service<Delivery, Response = Outcome>,
    S::Error: std::fmt::Display,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = future::ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, delivery: Delivery) -> Self::Future {
        let span = delivery_span(&delivery);
        let inner = {
            let _entered = span.enter();
            self.inner.call(delivery)
        };
        future::ResponseFuture::new(inner, span)
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
}
