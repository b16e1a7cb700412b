//! The future of [`Dedupe`](super::Dedupe).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::delivery::{BatchResults, Outcome};
use crate::error::BoxError;

type Inner = Pin<Box<dyn Future<Output = Result<Outcome, BoxError>> + Send>>;

/// Resolves once the transaction has committed (or to the error that stopped it).
pub struct ResponseFuture {
    inner: Inner,
}

impl ResponseFuture {
    pub(crate) fn new(
        inner: impl Future<Output = Result<Outcome, BoxError>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(inner),
        }
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Result<Outcome, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

type Batch = Pin<Box<dyn Future<Output = Result<BatchResults, BoxError>> + Send>>;

/// Resolves once the batch's transaction has committed, to one result per
/// delivery (or to the error that stopped the whole batch).
pub struct BatchFuture {
    inner: Batch,
}

impl BatchFuture {
    pub(crate) fn new(
        inner: impl Future<Output = Result<BatchResults, BoxError>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(inner),
        }
    }
}

impl fmt::Debug for BatchFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchFuture").finish_non_exhaustive()
    }
}

impl Future for BatchFuture {
    type Output = Result<BatchResults, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}
