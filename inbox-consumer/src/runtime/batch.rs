//! Several deliveries in one transaction: the batch's service call, the acks
//! of what it committed, and each delivery that failed in it retried alone.
//!
//! A batch holds at most one delivery per subject, so handling order per
//! subject is the same as one at a time. The service resolves once its one
//! transaction has committed (see [`Dedupe`](crate::Dedupe)'s batch mode), and
//! only then are the committed deliveries acked. A delivery whose handler
//! failed was left out of the committed transaction; it is then handled alone,
//! exactly as [`Consumer::run`](super::Consumer::run) would (nak, dead letter,
//! or an ordered consumer's in-place retry). A batch that could not reach the
//! database is nak'ed as a whole (or, ordered, retried in place); one that
//! failed as a whole for any other reason is retried one delivery at a time,
//! which isolates the culprit. So is a batch in which a handler (or a layer)
//! panicked: the panic is caught ([`panics`]), the batch's
//! transaction is dropped and rolls back, and each delivery is handled
//! alone, where only the one that panics again fails (counted, nak'ed, or
//! dead-lettered with reason `panic` once its budget is spent).

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::jetstream;
use futures::future::{BoxFuture, join_all};
use tokio::sync::watch;
use tower::{Service, ServiceExt};

use super::Job;
use super::ack::{self, UNAVAILABLE_MAX_DELAY};
use super::config::ConsumerConfig;
use super::panics::{self, Panicked};
use super::process::{self, Shared, with_progress_all};
use crate::delivery::{BatchResults, Delivery, Outcome};
use crate::error::{BoxError, Error, ErrorKind};

/// Handles `jobs` through `service` in one call; returns, per job, whether its
/// message is finished (acked, or dead-lettered and terminated).
pub(crate) async fn deliver_batch<S>(
    shared: Arc<Shared>,
    service: S,
    jobs: Vec<Job>,
    mut stopping: watch::Receiver<bool>,
) -> Vec<bool>
where
    S: Service<Vec<Delivery>, Response = BatchResults> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    let config = &shared.config;
    let count = jobs.len();
    let mut attempt: u64 = 0;
    loop {
        let error = match call_batch(&shared, service.clone(), &jobs).await {
            Called::Results(results) => {
                return settle(&shared, service, jobs, results, stopping).await;
            }
            Called::Panicked(panicked) => {
                // Which delivery panicked is not known: each is handled
                // alone, where the panic is pinned on its own event.
                let events: Vec<String> = jobs.iter().map(|(_, d)| d.id().to_string()).collect();
                tracing::error!(
                    consumer = %config.durable, deliveries = count, ?events, panic = %panicked.message(),
                    "a handler panicked in a batch: the batch rolled back; its deliveries are handled one at a time",
                );
                return alone(&shared, service, jobs, &stopping).await;
            }
            Called::Failed(error) => error,
        };
        let next = after_failure(error.as_ref(), config.ordered);
        match next {
            AfterFailure::Leave => {
                tracing::info!(
                    consumer = %config.durable, deliveries = count,
                    "another replica leads now: the batch rolled back, left for it",
                );
                return vec![false; count];
            }
            AfterFailure::Alone => {
                tracing::warn!(
                    consumer = %config.durable, deliveries = count, error = %error,
                    "the batch failed as a whole and rolled back; its deliveries are retried one at a time",
                );
                return alone(&shared, service, jobs, &stopping).await;
            }
            AfterFailure::Nak | AfterFailure::InPlace => {}
        }
        attempt = attempt.saturating_add(1);
        let delay = config.retry.delay(attempt).min(UNAVAILABLE_MAX_DELAY);
        log_unavailable(config, count, delay, error.as_ref(), next);
        let messages: Vec<&jetstream::Message> = jobs.iter().map(|(m, _)| m).collect();
        if next == AfterFailure::Nak {
            let naks = jobs
                .iter()
                .map(|(message, delivery)| process::nak(message, delivery.info(), delay, config));
            join_all(naks).await;
            return vec![false; count];
        }
        let wait = async {
            tokio::select! {
                () = tokio::time::sleep(delay) => true,
                _ = stopping.wait_for(|stop| *stop) => false,
            }
        };
        if !with_progress_all(wait, &messages, config).await {
            return vec![false; count];
        }
    }
}

/// How one call of the batch service ended.
enum Called {
    /// One result per delivery.
    Results(BatchResults),
    /// A handler (or layer) panicked.
    Panicked(Panicked),
    /// The batch failed as a whole (or answered the wrong number of results).
    Failed(BoxError),
}

/// One call of the batch service, in-progress acks sent while it runs.
async fn call_batch<S>(shared: &Shared, service: S, jobs: &[Job]) -> Called
where
    S: Service<Vec<Delivery>, Response = BatchResults>,
    S::Error: Into<BoxError>,
{
    let count = jobs.len();
    let deliveries: Vec<Delivery> = jobs.iter().map(|(_, d)| d.clone()).collect();
    let messages: Vec<&jetstream::Message> = jobs.iter().map(|(m, _)| m).collect();
    let call = service.oneshot(deliveries);
    let call = async move { call.await.map_err(Into::<BoxError>::into) };
    match process::running(panics::catch(call), &messages, &shared.config).await {
        Err(panicked) => Called::Panicked(panicked),
        Ok(Ok(results)) if results.len() == count => Called::Results(results),
        Ok(Ok(results)) => Called::Failed(Box::new(Error::new(
            ErrorKind::Config,
            format!(
                "the batch service answered {} results for {count} deliveries",
                results.len()
            ),
        ))),
        Ok(Err(e)) => Called::Failed(e),
    }
}

/// What follows a batch that failed as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AfterFailure {
    /// Another replica leads: leave the messages to it.
    Leave,
    /// The batch's own failure: handle each delivery alone, where the
    /// failure is pinned on its event.
    Alone,
    /// The database is unavailable (or refuses the role): nak all for
    /// redelivery.
    Nak,
    /// The same, ordered: retry the batch in place, its subjects waiting.
    InPlace,
}

/// What follows a batch that failed with `error` (see [`AfterFailure`]).
fn after_failure(
    error: &(dyn std::error::Error + Send + Sync + 'static),
    ordered: bool,
) -> AfterFailure {
    if ack::lease_lost(error) {
        AfterFailure::Leave
    } else if !ack::unavailable(error) {
        AfterFailure::Alone
    } else if ordered {
        AfterFailure::InPlace
    } else {
        AfterFailure::Nak
    }
}

/// The one line for a batch that will be tried again after `delay` because
/// the database could not be used, or refused the role.
fn log_unavailable(
    config: &ConsumerConfig,
    count: usize,
    delay: Duration,
    error: &(dyn std::error::Error + 'static),
    next: AfterFailure,
) {
    if outbox_pg::is_insufficient_privilege(error) {
        tracing::error!(
            consumer = %config.durable, deliveries = count, retry_in = ?delay, error = %error,
            "the consumer's database role lacks a privilege: the batch rolled back, retried until it is granted (never dead-lettered)",
        );
    } else if next == AfterFailure::InPlace {
        tracing::warn!(
            consumer = %config.durable, deliveries = count, retry_in = ?delay, error = %error,
            "the batch could not reach the database; retried in place, its subjects wait",
        );
    } else {
        tracing::warn!(
            consumer = %config.durable, deliveries = count, retry_in = ?delay, error = %error,
            "the batch could not reach the database; its messages are nak'ed",
        );
    }
}

/// Acks what the batch committed, then handles each failed delivery alone.
async fn settle<S>(
    shared: &Arc<Shared>,
    service: S,
    jobs: Vec<Job>,
    results: BatchResults,
    stopping: watch::Receiver<bool>,
) -> Vec<bool>
where
    S: Service<Vec<Delivery>, Response = BatchResults> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    let config = &shared.config;
    let mut finished = vec![true; jobs.len()];
    let mut committed = Vec::new();
    let mut failed = Vec::new();
    for (index, ((message, delivery), result)) in jobs.into_iter().zip(results).enumerate() {
        match result {
            Ok(_) => committed.push(message),
            Err(error) => {
                tracing::debug!(
                    consumer = %config.durable, event_id = %delivery.id(), subject = delivery.subject(),
                    error = %error, "delivery failed in its batch; handled alone next",
                );
                failed.push((index, (message, delivery)));
            }
        }
    }
    // The transaction has committed: only now are its messages acked.
    for e in ack::ack_all(&committed, config.ack_timeout).await {
        tracing::warn!(
            consumer = %config.durable, error = %e,
            "ack failed after commit; the redelivery will be a duplicate",
        );
    }
    for (index, (message, delivery)) in failed {
        let one = One(service.clone());
        finished[index] =
            process::deliver(Arc::clone(shared), one, message, delivery, stopping.clone()).await;
    }
    finished
}

/// Handles each job alone, one after the other.
async fn alone<S>(
    shared: &Arc<Shared>,
    service: S,
    jobs: Vec<Job>,
    stopping: &watch::Receiver<bool>,
) -> Vec<bool>
where
    S: Service<Vec<Delivery>, Response = BatchResults> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    let mut finished = Vec::with_capacity(jobs.len());
    for (message, delivery) in jobs {
        let one = One(service.clone());
        finished.push(
            process::deliver(Arc::clone(shared), one, message, delivery, stopping.clone()).await,
        );
    }
    finished
}

/// A batch service used for one delivery at a time.
#[derive(Clone, Debug)]
struct One<S>(S);

impl<S> Service<Delivery> for One<S>
where
    S: Service<Vec<Delivery>, Response = BatchResults>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Outcome, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, delivery: Delivery) -> Self::Future {
        let batch = self.0.call(vec![delivery]);
        Box::pin(async move {
            batch
                .await
                .map_err(Into::into)?
                .into_iter()
                .next()
                .unwrap_or_else(|| {
                    Err(Box::new(Error::new(
                        ErrorKind::Config,
                        "the batch service answered no result for one delivery",
                    )))
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_batch_is_left_split_naked_or_retried_in_place() {
        let lost: BoxError = Box::new(Error::new(ErrorKind::LeaseLost, "new leader"));
        let down: BoxError = Box::new(Error::database("beginning", sqlx::Error::PoolTimedOut));
        let own: BoxError = Box::new(crate::HandlerError::retry("bad row"));
        for ordered in [false, true] {
            assert_eq!(after_failure(lost.as_ref(), ordered), AfterFailure::Leave);
            assert_eq!(after_failure(own.as_ref(), ordered), AfterFailure::Alone);
        }
        assert_eq!(after_failure(down.as_ref(), false), AfterFailure::Nak);
        assert_eq!(after_failure(down.as_ref(), true), AfterFailure::InPlace);
    }
}
