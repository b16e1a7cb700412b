//! [`Metrics`] around a batch service: the same counters and histogram, per
//! delivery of the batch (each delivery's latency is its batch's).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use pin_project_lite::pin_project;
use tower::Service;

use super::{Metrics, record};
use crate::delivery::{BatchResults, Delivery};

type Labels = [(&'static str, String); 2];

impl<S> Service<Vec<Delivery>> for Metrics<S>
where
    S: Service<Vec<Delivery>, Response = BatchResults>,
{
    type Response = BatchResults;
    type Error = S::Error;
    type Future = BatchFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, deliveries: Vec<Delivery>) -> Self::Future {
        let labels = deliveries
            .iter()
            .map(|delivery| {
                [
                    ("consumer", delivery.consumer().to_owned()),
                    ("event_type", delivery.event_type().as_str().to_owned()),
                ]
            })
            .collect();
        BatchFuture {
            inner: self.inner.call(deliveries),
            start: Instant::now(),
            labels,
        }
    }
}

pin_project! {
    /// Records each delivery's outcome and the batch's latency when the inner
    /// future resolves. A batch that failed as a whole counts every delivery failed.
    #[derive(Debug)]
    pub struct BatchFuture<F> {
        #[pin]
        inner: F,
        start: Instant,
        labels: Vec<Labels>,
    }
}

impl<F, E> Future for BatchFuture<F>
where
    F: Future<Output = Result<BatchResults, E>>,
{
    type Output = Result<BatchResults, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let out = ready!(this.inner.poll(cx));
        let seconds = this.start.elapsed().as_secs_f64();
        match &out {
            Ok(results) => {
                for (labels, result) in this.labels.iter().zip(results) {
                    record(labels, result.as_ref().ok(), seconds);
                }
            }
            Err(_) => {
                for labels in this.labels.iter() {
                    record(labels, None, seconds);
                }
            }
        }
        Poll::Ready(out)
    }
}
