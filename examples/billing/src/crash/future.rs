//! The future of [`CrashAfterCommit`](super::CrashAfterCommit).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use pin_project_lite::pin_project;

use super::{Committed, CrashMode, Dice};

pin_project! {
    /// Resolves as the inner future does, unless the dice say crash after a
    /// committed delivery: then the process aborts, or the future stays
    /// pending for ever.
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        dice: Arc<Dice>,
        mode: CrashMode,
        frozen: bool,
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn new(inner: F, dice: Arc<Dice>, mode: CrashMode) -> Self {
        Self {
            inner,
            dice,
            mode,
            frozen: false,
        }
    }
}

impl<F> fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("mode", &self.mode)
            .field("frozen", &self.frozen)
            .finish_non_exhaustive()
    }
}

impl<F, R, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<R, E>>,
    R: Committed,
{
    type Output = Result<R, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if *this.frozen {
            return Poll::Pending;
        }
        let out = ready!(this.inner.poll(cx));
        if out.as_ref().is_ok_and(Committed::committed) && this.dice.roll() {
            match this.mode {
                CrashMode::Abort => {
                    tracing::warn!("injected crash: aborting after a commit, before the ack");
                    std::process::abort();
                }
                CrashMode::Freeze => {
                    tracing::warn!("injected crash: freezing after a commit, before the ack");
                    *this.frozen = true;
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(out)
    }
}
