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

use async_nats::jetstream::{self, AckKind};
use futures::future::{BoxFuture, join_all};
use tokio::sync::watch;
use tower::{Service, ServiceExt};

use super::Job;
use super::ack::{self, UNAVAILABLE_MAX_DELAY};
use super::panics;
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
        let deliveries: Vec<Delivery> = jobs.iter().map(|(_, d)| d.clone()).collect();
        let messages: Vec<&jetstream::Message> = jobs.iter().map(|(m, _)| m).collect();
        let batch_service = service.clone();
        let call = async move {
            batch_service
                .oneshot(deliveries)
                .await
                .map_err(Into::<BoxError>::into)
        };
        let result = match with_progress_all(panics::catch(call), &messages, config).await {
            Ok(result) => result,
            Err(panicked) => {
                // Which delivery panicked is not known: each is handled
                // alone, where the panic is pinned on its own event.
                let events: Vec<String> = jobs.iter().map(|(_, d)| d.id().to_string()).collect();
                tracing::error!(
                    consumer = %config.durable, deliveries = count, ?events, panic = %panicked.message(),
                    "a handler panicked in a batch: the batch rolled back; its deliveries are handled one at a time",
                );
                return alone(&shared, service, jobs, &stopping).await;
            }
        };
        let error: BoxError = match result {
            Ok(results) if results.len() == count => {
                return settle(&shared, service, jobs, results, stopping).await;
            }
            Ok(results) => Box::new(Error::new(
                ErrorKind::Config,
                format!(
                    "the batch service answered {} results for {count} deliveries",
                    results.len()
                ),
            )),
            Err(e) => e,
        };
        if ack::lease_lost(error.as_ref()) {
            tracing::info!(
                consumer = %config.durable, deliveries = count,
                "another replica leads now: the batch rolled back, left for it",
            );
            return vec![false; count];
        }
        if !ack::unavailable(error.as_ref()) {
            tracing::warn!(
                consumer = %config.durable, deliveries = count, error = %error,
                "the batch failed as a whole and rolled back; its deliveries are retried one at a time",
            );
            return alone(&shared, service, jobs, &stopping).await;
        }
        attempt = attempt.saturating_add(1);
        let delay = config.retry.delay(attempt).min(UNAVAILABLE_MAX_DELAY);
        let refused = outbox_pg::is_insufficient_privilege(error.as_ref());
        if refused {
            tracing::error!(
                consumer = %config.durable, deliveries = count, retry_in = ?delay, error = %error,
                "the consumer's database role lacks a privilege: the batch rolled back, retried until it is granted (never dead-lettered)",
            );
        }
        if !config.ordered {
            if !refused {
                tracing::warn!(
                    consumer = %config.durable, deliveries = count, retry_in = ?delay, error = %error,
                    "the batch could not reach the database; its messages are nak'ed",
                );
            }
            let naks = jobs
                .iter()
                .map(|(message, delivery)| process::nak(message, delivery.info(), delay, config));
            join_all(naks).await;
            return vec![false; count];
        }
        if !refused {
            tracing::warn!(
                consumer = %config.durable, deliveries = count, retry_in = ?delay, error = %error,
                "the batch could not reach the database; retried in place, its subjects wait",
            );
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
    let acks = committed.iter().map(|message| async move {
        if let Err(e) = ack::send(message, AckKind::Ack, config.ack_timeout).await {
            tracing::warn!(
                consumer = %config.durable, error = %e,
                "ack failed after commit; the redelivery will be a duplicate",
            );
        }
    });
    join_all(acks).await;
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
