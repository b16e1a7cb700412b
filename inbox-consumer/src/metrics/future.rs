//! The future of [`Metrics`](super::Metrics).

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use pin_project_lite::pin_project;

use super::{Keys, record};
use crate::delivery::Deliveries;

pin_project! {
    /// Records each delivery's outcome and latency (a batch's, for each of
    /// its deliveries) when the inner future resolves.
    #[derive(Debug)]
    pub struct ResponseFuture<F, R> {
        #[pin]
        inner: F,
        start: Instant,
        keys: Vec<Arc<Keys>>,
        request: PhantomData<fn() -> R>,
    }
}

impl<F, R> ResponseFuture<F, R> {
    pub(crate) fn new(inner: F, start: Instant, keys: Vec<Arc<Keys>>) -> Self {
        Self {
            inner,
            start,
            keys,
            request: PhantomData,
        }
    }
}

impl<F, R, E> Future for ResponseFuture<F, R>
where
    R: Deliveries,
    F: Future<Output = Result<R::Response, E>>,
{
    type Output = Result<R::Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let out = ready!(this.inner.poll(cx));
        let seconds = this.start.elapsed().as_secs_f64();
        match &out {
            Ok(response) => {
                for (keys, result) in this.keys.iter().zip(R::results(response)) {
                    record(keys, result.ok().as_ref(), seconds);
                }
            }
            Err(_) => {
                for keys in this.keys.iter() {
                    record(keys, None, seconds);
                }
            }
        }
        Poll::Ready(out)
    }
}
