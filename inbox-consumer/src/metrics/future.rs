//! The future of [`Metrics`](super::Metrics).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use pin_project_lite::pin_project;

use crate::delivery::Outcome;

pin_project! {
    /// Records the outcome and latency when the inner future resolves.
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        start: Instant,
        labels: [(&'static str, String); 2],
    }
}

impl<F> ResponseFuture<F> {
    pub(crate) fn new(inner: F, start: Instant, labels: [(&'static str, String); 2]) -> Self {
        Self {
            inner,
            start,
            labels,
        }
    }
}

impl<F, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Outcome, E>>,
{
    type Output = Result<Outcome, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let out = ready!(this.inner.poll(cx));
        let seconds = this.start.elapsed().as_secs_f64();
        super::record(this.labels, out.as_ref().ok(), seconds);
        Poll::Ready(out)
    }
}
