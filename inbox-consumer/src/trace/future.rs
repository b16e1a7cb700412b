//! The future of [`Trace`](super::Trace).

use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;

use crate::delivery::Outcome;

pin_project! {
    /// Polls the inner future inside the delivery's span and records the outcome.
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        span: tracing::Span,
    }
}

impl<F> ResponseFuture<F> {
    pub(crate) fn new(inner: F, span: tracing::Span) -> Self {
        Self { inner, span }
    }
}

impl<F, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Outcome, E>>,
    E: Display,
{
    type Output = Result<Outcome, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        // Entered for this poll only, like `tracing::Instrumented`.
        let _entered = this.span.enter();
        let out = ready!(this.inner.poll(cx));
        match &out {
            Ok(outcome) => {
                this.span.record("outcome", outcome.as_str());
            }
            Err(e) => {
                this.span.record("outcome", "failed");
                this.span.record("error", tracing::field::display(e));
            }
        }
        Poll::Ready(out)
    }
}
