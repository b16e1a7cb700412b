//! Fault injection, **for tests only**: die between commit and ack.
//!
//! [`CrashAfterCommit`] wraps a stack whose future resolves once the
//! handler's transaction has committed — [`Dedupe`](inbox_consumer::Dedupe),
//! or [`Transactional`](crate::Transactional) without the inbox — and sits
//! outside it, so that it runs after the commit and before the runtime acks.
//! With the configured probability, after a delivery was handled and
//! committed, it
//!
//! - [`CrashMode::Abort`]: calls [`std::process::abort`] — the process dies
//!   with the effect committed and the message unacked, so JetStream
//!   redelivers it after `ack_wait` and the inbox must make the copy a
//!   duplicate (the `billing --crash-after-commit` switch);
//! - [`CrashMode::Freeze`]: never resolves, like a process frozen at that
//!   point, for in-process tests that then abort the consumer task.
//!
//! The dice come from a seeded RNG (`--seed`), so a run can be repeated;
//! with concurrency the order deliveries finish in still varies.

mod future;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use inbox_consumer::{BatchResults, Outcome};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tower::{Layer, Service};

pub use future::ResponseFuture;

/// What a crash does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CrashMode {
    /// `std::process::abort()`: the whole process dies.
    Abort,
    /// The delivery never completes (and is never acked); the process goes on.
    Freeze,
}

/// The dice and the count, shared by every clone of a layer and its services.
struct Dice {
    probability: f64,
    rng: Mutex<StdRng>,
    crashes: AtomicU64,
}

impl Dice {
    /// Rolls; true means crash now.
    fn roll(&self) -> bool {
        if self.probability <= 0.0 {
            return false;
        }
        let crash = match self.rng.lock() {
            Ok(mut rng) => rng.random_bool(self.probability),
            // Only a panic while rolling could poison it; roll on regardless.
            Err(poisoned) => poisoned.into_inner().random_bool(self.probability),
        };
        if crash {
            self.crashes.fetch_add(1, Ordering::SeqCst);
        }
        crash
    }
}

/// Applies [`CrashAfterCommit`]. Clones share the RNG and the crash count.
#[derive(Clone)]
pub struct CrashAfterCommitLayer {
    dice: Arc<Dice>,
    mode: CrashMode,
}

impl CrashAfterCommitLayer {
    /// Crashes after a committed delivery with `probability` (clamped to
    /// 0..=1; NaN counts as 0), rolling dice seeded with `seed`. Aborts the
    /// process; see [`freeze`](Self::freeze).
    pub fn new(probability: f64, seed: u64) -> Self {
        let probability = if probability.is_nan() {
            0.0
        } else {
            probability.clamp(0.0, 1.0)
        };
        Self {
            dice: Arc::new(Dice {
                probability,
                rng: Mutex::new(StdRng::seed_from_u64(seed)),
                crashes: AtomicU64::new(0),
            }),
            mode: CrashMode::Abort,
        }
    }

    /// Freezes the delivery instead of aborting the process.
    #[must_use]
    pub fn freeze(mut self) -> Self {
        self.mode = CrashMode::Freeze;
        self
    }

    /// What a crash does.
    pub fn mode(&self) -> CrashMode {
        self.mode
    }

    /// The probability of a crash after each committed delivery.
    pub fn probability(&self) -> f64 {
        self.dice.probability
    }

    /// How many crashes happened so far (frozen deliveries, in
    /// [`CrashMode::Freeze`]).
    pub fn crashes(&self) -> u64 {
        self.dice.crashes.load(Ordering::SeqCst)
    }
}

impl fmt::Debug for CrashAfterCommitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CrashAfterCommitLayer")
            .field("probability", &self.dice.probability)
            .field("mode", &self.mode)
            .field("crashes", &self.crashes())
            .finish()
    }
}

impl<S> Layer<S> for CrashAfterCommitLayer {
    type Service = CrashAfterCommit<S>;

    fn layer(&self, inner: S) -> CrashAfterCommit<S> {
        CrashAfterCommit {
            inner,
            layer: self.clone(),
        }
    }
}

/// Crashes, with some probability, after the inner service committed a
/// delivery and before the runtime acks it. See the [module docs](self).
#[derive(Clone, Debug)]
pub struct CrashAfterCommit<S> {
    inner: S,
    layer: CrashAfterCommitLayer,
}

impl<S> CrashAfterCommit<S> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// A response that tells whether something committed: a handled delivery, or
/// a batch with at least one.
pub trait Committed {
    /// Whether the response follows a commit of some effect.
    fn committed(&self) -> bool;
}

impl Committed for Outcome {
    fn committed(&self) -> bool {
        // Only a handled delivery committed something: a duplicate or a
        // stale event rolled back, an error was never committed.
        *self == Outcome::Handled
    }
}

impl Committed for BatchResults {
    fn committed(&self) -> bool {
        self.iter().any(|r| matches!(r, Ok(Outcome::Handled)))
    }
}

impl<S, Request> Service<Request> for CrashAfterCommit<S>
where
    S: Service<Request>,
    S::Response: Committed,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        ResponseFuture::new(
            self.inner.call(request),
            Arc::clone(&self.layer.dice),
            self.layer.mode,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tower::{ServiceExt, service_fn};

    use super::*;

    fn handled() -> impl Service<(), Response = Outcome, Error = &'static str, Future: Send> + Clone
    {
        service_fn(|()| async { Ok::<_, &'static str>(Outcome::Handled) })
    }

    #[tokio::test]
    async fn never_crashes_at_probability_zero() {
        let layer = CrashAfterCommitLayer::new(0.0, 7).freeze();
        for _ in 0..100 {
            let out = layer.layer(handled()).oneshot(()).await.unwrap();
            assert_eq!(out, Outcome::Handled);
        }
        assert_eq!(layer.crashes(), 0);
    }

    #[tokio::test]
    async fn freezes_after_a_commit_at_probability_one() {
        let layer = CrashAfterCommitLayer::new(1.0, 7).freeze();
        let frozen = tokio::time::timeout(
            Duration::from_millis(50),
            layer.layer(handled()).oneshot(()),
        )
        .await;
        assert!(frozen.is_err(), "the delivery must never complete");
        assert_eq!(layer.crashes(), 1);
    }

    #[tokio::test]
    async fn only_committed_deliveries_crash() {
        let layer = CrashAfterCommitLayer::new(1.0, 7).freeze();
        let duplicate = service_fn(|()| async { Ok::<_, &'static str>(Outcome::Duplicate) });
        let failing = service_fn(|()| async { Err::<Outcome, _>("rolled back") });
        assert_eq!(
            layer.layer(duplicate).oneshot(()).await.unwrap(),
            Outcome::Duplicate
        );
        assert!(layer.layer(failing).oneshot(()).await.is_err());
        assert_eq!(layer.crashes(), 0);
    }

    #[test]
    fn the_same_seed_rolls_the_same_dice() {
        let rolls = |seed| {
            let layer = CrashAfterCommitLayer::new(0.3, seed);
            (0..64).map(|_| layer.dice.roll()).collect::<Vec<_>>()
        };
        assert_eq!(rolls(42), rolls(42));
        assert_ne!(rolls(42), rolls(43));
        assert_eq!(CrashAfterCommitLayer::new(f64::NAN, 1).probability(), 0.0);
        assert_eq!(CrashAfterCommitLayer::new(2.0, 1).probability(), 1.0);
    }
}
