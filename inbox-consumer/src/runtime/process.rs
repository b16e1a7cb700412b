//! One message, from the service call to its acknowledgement.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use outbox_pg::EventId;
use sqlx::PgPool;
use tokio::sync::watch;
use tower::{Service, ServiceExt};

use super::ack::{self, Decision};
use super::config::ConsumerConfig;
use super::panics::{self, Panicked};
use crate::dead_letter::{DeadLetter, Poison, Reason};
use crate::delivery::{Delivery, DeliveryInfo, Outcome};
use crate::error::BoxError;
use crate::metrics::names;

/// What every message task shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) js: jetstream::Context,
    pub(crate) pool: PgPool,
    pub(crate) config: ConsumerConfig,
    /// Told when messages were settled: the ack floor may have risen.
    pub(crate) settled: tokio::sync::Notify,
}

/// Handles one decoded delivery: service (→ commit) → ack, or nak, or dead
/// letter. An ordered consumer retries in place instead of nak'ing, so that
/// nothing later of the subject overtakes it; once `stopping` turns true it
/// stops retrying and leaves the message to the next leader. A panic of the
/// service call (ready, call or future) is caught and fails the attempt like
/// an error ([`panics`]). Returns whether the message is finished (acked, or
/// dead-lettered and terminated).
pub(crate) async fn deliver<S>(
    shared: Arc<Shared>,
    service: S,
    message: jetstream::Message,
    delivery: Delivery,
    mut stopping: watch::Receiver<bool>,
) -> bool
where
    S: Service<Delivery, Response = Outcome> + Clone,
    S::Error: Into<BoxError>,
{
    let info = delivery.info().clone();
    let event_id = delivery.id();
    let event_type = delivery.event_type().as_str().to_owned();
    let mut attempt = info.delivered;
    let (result, decision) = loop {
        let (attempt_service, attempt_delivery) = (service.clone(), delivery.clone());
        let call = async move {
            attempt_service
                .oneshot(attempt_delivery)
                .await
                .map_err(Into::into)
        };
        let result = match with_progress(panics::catch(call), &message, &shared.config).await {
            Ok(result) => result,
            Err(panicked) => {
                panics::count(&info.consumer, &event_type);
                Err(BoxError::from(panicked))
            }
        };
        let decision = ack::decide(&result, attempt, &shared.config);
        match decision {
            Decision::Nak(delay) if shared.config.ordered => {
                if let Some(panicked) = panicked(&result) {
                    log_panic(&delivery, attempt, panicked, Next::InPlace(delay));
                } else if refused(&result) {
                    let error = result.err().map(|e| e.to_string()).unwrap_or_default();
                    tracing::error!(
                        consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
                        stream_sequence = info.stream_sequence, attempt, retry_in = ?delay, error = %error,
                        "the consumer's database role lacks a privilege: rolled back, retried in place until it is granted (never dead-lettered)",
                    );
                } else {
                    let error = result.err().map(|e| e.to_string()).unwrap_or_default();
                    tracing::warn!(
                        consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
                        subject = delivery.subject(), stream_sequence = info.stream_sequence,
                        attempt, retry_in = ?delay, error = %error,
                        "delivery failed and rolled back; retried in place, its subject waits",
                    );
                }
                let wait = async {
                    tokio::select! {
                        () = tokio::time::sleep(delay) => true,
                        _ = stopping.wait_for(|stop| *stop) => false,
                    }
                };
                if !with_progress(wait, &message, &shared.config).await {
                    tracing::info!(
                        consumer = %info.consumer, event_id = %event_id, stream_sequence = info.stream_sequence,
                        "shutting down: the retry is left to the next leader",
                    );
                    return false;
                }
                attempt = attempt.saturating_add(1);
            }
            decision => break (result, decision),
        }
    };
    match decision {
        Decision::Ack(_) => {
            // The transaction has committed: only now is the message acked.
            if let Err(e) = ack::send(&message, AckKind::Ack, shared.config.ack_timeout).await {
                tracing::warn!(
                    consumer = %info.consumer, event_id = %event_id, stream_sequence = info.stream_sequence,
                    error = %e,
                    "ack failed after commit; the redelivery will be a duplicate",
                );
            }
            true
        }
        Decision::Unrouted => {
            metrics::counter!(
                names::UNROUTED,
                "consumer" => info.consumer.clone(),
                "event_type" => event_type.clone(),
            )
            .increment(1);
            tracing::debug!(
                consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
                "no route for this event type: acked without an effect",
            );
            if let Err(e) = ack::send(&message, AckKind::Ack, shared.config.ack_timeout).await {
                tracing::warn!(
                    consumer = %info.consumer, event_id = %event_id, error = %e,
                    "ack of an unrouted message failed; it will be redelivered",
                );
            }
            true
        }
        Decision::Nak(delay) => {
            if let Some(panicked) = panicked(&result) {
                log_panic(&delivery, attempt, panicked, Next::Redelivery(delay));
                nak(&message, &info, delay, &shared.config).await;
                return false;
            }
            let refused = refused(&result);
            let error = result.err().map(|e| e.to_string()).unwrap_or_default();
            if refused {
                tracing::error!(
                    consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
                    stream_sequence = info.stream_sequence, retry_in = ?delay, error = %error,
                    "the consumer's database role lacks a privilege: rolled back, redelivered until it is granted (never dead-lettered)",
                );
                nak(&message, &info, delay, &shared.config).await;
                return false;
            }
            tracing::warn!(
                consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
                subject = delivery.subject(), stream_sequence = info.stream_sequence, delivered = info.delivered,
                retry_in = ?delay, error = %error,
                "delivery failed and rolled back; it will be redelivered",
            );
            nak(&message, &info, delay, &shared.config).await;
            false
        }
        Decision::DeadLetter(reason) => {
            if let Some(panicked) = panicked(&result) {
                log_panic(&delivery, attempt, panicked, Next::DeadLetter);
            }
            let error = result
                .err()
                .map(|e| error_chain(e.as_ref()))
                .unwrap_or_default();
            dead_letter(&shared, &message, &info, Some(event_id), reason, error).await
        }
        Decision::Abandon => {
            tracing::info!(
                consumer = %info.consumer, event_id = %event_id, stream_sequence = info.stream_sequence,
                "another replica leads now: rolled back, left for it",
            );
            false
        }
    }
}

/// Dead-letters a message that failed to decode.
pub(crate) async fn poison(
    shared: Arc<Shared>,
    message: jetstream::Message,
    info: DeliveryInfo,
    poison: Poison,
) -> bool {
    let error = error_chain(&poison);
    dead_letter(
        &shared,
        &message,
        &info,
        poison.event_id(),
        poison.reason(),
        error,
    )
    .await
}

/// Records a dead letter, then terminates the message; if recording fails,
/// naks it so that dead-lettering is tried again. Returns whether it was
/// recorded.
async fn dead_letter(
    shared: &Shared,
    message: &jetstream::Message,
    info: &DeliveryInfo,
    event_id: Option<EventId>,
    reason: Reason,
    error: String,
) -> bool {
    let letter = DeadLetter {
        info,
        event_id,
        reason,
        error,
        headers: message.headers.as_ref(),
        payload: &message.payload,
    };
    let recorded = async {
        let id = letter.insert(&shared.pool).await?;
        if let Some(subject) = &shared.config.dead_letter_subject {
            letter
                .publish(&shared.js, subject, shared.config.ack_timeout)
                .await?;
        }
        Ok::<_, crate::Error>(id)
    }
    .await;
    match recorded {
        Ok(id) => {
            metrics::counter!(
                names::DEAD_LETTERED,
                "consumer" => info.consumer.clone(),
                "event_type" => info.nats_subject.clone(),
                "reason" => reason.as_str(),
            )
            .increment(1);
            tracing::warn!(
                consumer = %info.consumer, dead_letter_id = id, reason = %reason,
                event_id = event_id.map(|id| id.to_string()), stream_sequence = info.stream_sequence,
                delivered = info.delivered, error = %letter.error,
                "message dead-lettered and terminated",
            );
            if let Err(e) = ack::send(message, AckKind::Term, shared.config.ack_timeout).await {
                tracing::warn!(
                    consumer = %info.consumer, stream_sequence = info.stream_sequence, error = %e,
                    "term failed after dead-lettering; a redelivery will be dead-lettered again",
                );
            }
            true
        }
        Err(e) => {
            tracing::error!(
                consumer = %info.consumer, reason = %reason, stream_sequence = info.stream_sequence,
                delivered = info.delivered, error = %e,
                "could not record a dead letter; the message is nak'ed to try again",
            );
            nak(
                message,
                info,
                shared.config.retry.delay(info.delivered),
                &shared.config,
            )
            .await;
            false
        }
    }
}

pub(crate) async fn nak(
    message: &jetstream::Message,
    info: &DeliveryInfo,
    delay: Duration,
    config: &ConsumerConfig,
) {
    if let Err(e) = ack::send(message, AckKind::Nak(Some(delay)), config.ack_timeout).await {
        tracing::warn!(
            consumer = %info.consumer, stream_sequence = info.stream_sequence, error = %e,
            "nak failed; the message will be redelivered after ack_wait",
        );
    }
}

/// Runs `fut`, sending an in-progress ack every `progress_every` until it finishes.
async fn with_progress<F: Future>(
    fut: F,
    message: &jetstream::Message,
    config: &ConsumerConfig,
) -> F::Output {
    with_progress_all(fut, &[message], config).await
}

/// Runs `fut`, sending an in-progress ack for each of `messages` every
/// `progress_every` until it finishes.
pub(crate) async fn with_progress_all<F: Future>(
    fut: F,
    messages: &[&jetstream::Message],
    config: &ConsumerConfig,
) -> F::Output {
    let every = config.progress_every();
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut fut = std::pin::pin!(fut);
    loop {
        tokio::select! {
            out = &mut fut => return out,
            _ = ticks.tick() => {
                for message in messages {
                    if let Err(e) = ack::send(message, AckKind::Progress, config.ack_timeout).await {
                        tracing::debug!(error = %e, "in-progress ack failed");
                    }
                }
            }
        }
    }
}

/// The panic a failed delivery stands for, if its service call panicked.
fn panicked(result: &Result<Outcome, BoxError>) -> Option<&Panicked> {
    result.as_ref().err()?.downcast_ref::<Panicked>()
}

/// What follows a panicked attempt.
#[derive(Debug, Clone, Copy)]
enum Next {
    /// Retried in place after the delay (ordered).
    InPlace(Duration),
    /// Nak'ed, redelivered after the delay.
    Redelivery(Duration),
    /// The budget is spent: dead-lettered.
    DeadLetter,
}

/// The runtime's one line for a panicked attempt: the event, the attempt,
/// the panic's message and what happens next. (The process's panic hook
/// printed its own, to stderr, without the event.)
fn log_panic(delivery: &Delivery, attempt: u64, panicked: &Panicked, next: Next) {
    let info = delivery.info();
    let (event_id, event_type) = (delivery.id(), delivery.event_type());
    match next {
        Next::InPlace(delay) => tracing::error!(
            consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
            subject = delivery.subject(), stream_sequence = info.stream_sequence,
            attempt, retry_in = ?delay, panic = %panicked.message(),
            "the handler panicked: rolled back, retried in place, its subject waits",
        ),
        Next::Redelivery(delay) => tracing::error!(
            consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
            subject = delivery.subject(), stream_sequence = info.stream_sequence,
            attempt, retry_in = ?delay, panic = %panicked.message(),
            "the handler panicked: rolled back, nak'ed for redelivery",
        ),
        Next::DeadLetter => tracing::error!(
            consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
            subject = delivery.subject(), stream_sequence = info.stream_sequence,
            attempt, panic = %panicked.message(),
            "the handler panicked on the last delivery its budget allows: rolled back, dead-lettered (reason panic)",
        ),
    }
}

/// Whether the delivery failed on a privilege the role lacks (SQLSTATE 42501).
fn refused(result: &Result<Outcome, BoxError>) -> bool {
    result
        .as_ref()
        .err()
        .is_some_and(|e| outbox_pg::is_insufficient_privilege(e.as_ref()))
}

/// `error: cause: cause…`, for the dead-letter row.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
