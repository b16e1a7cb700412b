//! A span per request, `http.request`, that the handlers write their rows and
//! events in.
//!
//! The outbox writes the span's trace context on every event it enqueues
//! (`outbox-pg`'s `opentelemetry` feature), so the consumers' handling of an
//! event is in the request's trace. With the `opentelemetry` feature the span
//! also continues the caller's trace when the request carries a W3C
//! `traceparent` header (and `tracestate`): one trace from the caller,
//! through the write, to every consumer.

use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;
use tracing::field::Empty;

/// Runs the rest of the request inside its `http.request` span.
pub(crate) async fn request_span(request: Request, next: Next) -> Response {
    let span = tracing::info_span!(
        "http.request",
        otel.kind = "server",
        http.request.method = %request.method(),
        url.path = request.uri().path(),
        http.response.status_code = Empty,
    );
    #[cfg(feature = "opentelemetry")]
    if let Some(caller) = caller_context(request.headers()) {
        // Fails only without an OpenTelemetry layer: no trace to continue.
        let _ = tracing_opentelemetry::OpenTelemetrySpanExt::set_parent(&span, caller);
    }
    let response = next.run(request).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    response
}

/// The caller's span, from its `traceparent` and `tracestate` headers.
#[cfg(feature = "opentelemetry")]
fn caller_context(headers: &axum::http::HeaderMap) -> Option<opentelemetry::Context> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    outbox_pg::trace_context::remote_parent(header("traceparent")?, header("tracestate"))
}
