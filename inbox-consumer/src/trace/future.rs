//! The future of [`Trace`](super::Trace).

use std::fmt::Display;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;

use crate::delivery::Deliveries;

pin_project! {
    /// Polls the inner future inside its span (one delivery's, or a
    /// batch's) and closes each delivery's span with its outcome or error.
    #[derive(Debug)]
    pub struct ResponseFuture<F, R> {
        #[pin]
        inner: F,
        span: tracing::Span,
        spans: Vec<tracing::Span>,
        request: PhantomData<fn() -> R>,
    }
}

impl<F, R> ResponseFuture<F, R> {
    pub(crate) fn new(inner: F, span: tracing::Span, spans: Vec<tracing::Span>) -> Self {
        Self {
            inner,
            span,
            spans,
            request: PhantomData,
        }
    }
}

impl<F, R, E> Future for ResponseFuture<F, R>
where
    R: Deliveries,
    F: Future<Output = Result<R::Response, E>>,
    E: Display,
{
    type Output = Result<R::Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let _entered = this.span.enter();
        let out = ready!(this.inner.poll(cx));
        match &out {
            Ok(response) => {
                for (span, result) in this.spans.iter().zip(R::results(response)) {
                    match result {
                        Ok(outcome) => failed_or(span, Ok(outcome.as_str())),
                        Err(e) => failed_or(span, Err(e)),
                    }
                }
            }
            Err(e) => {
                for span in this.spans.iter() {
                    failed_or(span, Err(e));
                }
            }
        }
        this.spans.clear();
        Poll::Ready(out)
    }
}

/// Records `outcome` on `span`, or `failed` and the error.
fn failed_or(span: &tracing::Span, outcome: Result<&'static str, &dyn Display>) {
    match outcome {
        Ok(outcome) => {
            span.record("outcome", outcome);
        }
        Err(e) => {
            span.record("outcome", "failed");
            span.record("error", tracing::field::display(e));
        }
    }
}
