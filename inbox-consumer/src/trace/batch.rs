//! [`Trace`] around a batch service: an `inbox.batch` span, and inside it one
//! `inbox.delivery` span per delivery (in its writer's trace as in single
//! mode), each closed with its own outcome when the batch resolves. Each
//! delivery carries its span down the stack, and
//! [`HandlerService`](crate::HandlerService) runs its handler in it. With the
//! `opentelemetry` feature the batch span is linked to every writer's span.

use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;
use tower::Service;

use super::{Trace, delivery_span};
use crate::delivery::{BatchResults, Delivery};

impl<S> Service<Vec<Delivery>> for Trace<S>
where
    S: Service<Vec<Delivery>, Response = BatchResults>,
    S::Error: Display,
{
    type Response = BatchResults;
    type Error = S::Error;
    type Future = BatchFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, deliveries: Vec<Delivery>) -> Self::Future {
        let span = tracing::info_span!(
            "inbox.batch",
            consumer = deliveries.first().map(Delivery::consumer),
            deliveries = deliveries.len(),
        );
        #[cfg(feature = "opentelemetry")]
        for delivery in &deliveries {
            if let Some(writer) = super::writer_context(delivery) {
                use opentelemetry::trace::TraceContextExt;
                tracing_opentelemetry::OpenTelemetrySpanExt::add_link(
                    &span,
                    writer.span().span_context().clone(),
                );
            }
        }
        let (spans, inner) = {
            let _entered = span.enter();
            let mut spans = Vec::with_capacity(deliveries.len());
            let deliveries = deliveries
                .into_iter()
                .map(|delivery| {
                    let span = delivery_span(&delivery);
                    spans.push(span.clone());
                    delivery.in_span(span)
                })
                .collect();
            (spans, self.inner.call(deliveries))
        };
        BatchFuture { inner, span, spans }
    }
}

pin_project! {
    /// Polls the batch inside its span and closes each delivery's span with
    /// its outcome.
    #[derive(Debug)]
    pub struct BatchFuture<F> {
        #[pin]
        inner: F,
        span: tracing::Span,
        spans: Vec<tracing::Span>,
    }
}

impl<F, E> Future for BatchFuture<F>
where
    F: Future<Output = Result<BatchResults, E>>,
    E: Display,
{
    type Output = Result<BatchResults, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let _entered = this.span.enter();
        let out = ready!(this.inner.poll(cx));
        match &out {
            Ok(results) => {
                for (span, result) in this.spans.iter().zip(results) {
                    match result {
                        Ok(outcome) => {
                            span.record("outcome", outcome.as_str());
                        }
                        Err(e) => {
                            span.record("outcome", "failed");
                            span.record("error", tracing::field::display(e));
                        }
                    }
                }
            }
            Err(e) => {
                for span in this.spans.iter() {
                    span.record("outcome", "failed");
                    span.record("error", tracing::field::display(e));
                }
            }
        }
        this.spans.clear();
        Poll::Ready(out)
    }
}
