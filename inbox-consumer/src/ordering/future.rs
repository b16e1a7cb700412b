//! The future of [`SkipStale`](super::SkipStale).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::delivery::{InTx, Outcome};
use crate::error::BoxError;

type Inner = Pin<Box<dyn Future<Output = Result<InTx<Outcome>, BoxError>> + Send>>;

/// Resolves to the inner service's response, or to [`Outcome::Stale`].
pub struct ResponseFuture {
    inner: Inner,
}

impl ResponseFuture {
    pub(crate) fn new(
        inner: impl Future<Output = Result<InTx<Outcome>, BoxError>> + Send + 'static,
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
    type Output = Result<InTx<Outcome>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}
