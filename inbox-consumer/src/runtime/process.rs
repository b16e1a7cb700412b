//! One message, from the service call to its acknowledgement.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use outbox_pg::EventId;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::time::Instant;
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
    /// The durable's info as the lag task last read it ([`super::lag`]),
    /// for the other tasks that judge by it ([`super::ghosts`]).
    pub(crate) info: watch::Sender<Option<jetstream::consumer::Info>>,
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
    let mut attempt = delivery.info().delivered;
    loop {
        let result = call(&shared, service.clone(), &message, &delivery).await;
        match ack::decide(&result, attempt, &shared.config) {
            Decision::Nak(delay) if shared.config.ordered => {
                log_failure(&delivery, attempt, &result, Next::InPlace(delay));
                if !wait_in_place(&shared, &message, &delivery, delay, &mut stopping).await {
                    return false;
                }
                attempt = attempt.saturating_add(1);
            }
            decision => {
                return settle(&shared, &message, &delivery, attempt, result, decision).await;
            }
        }
    }
}

/// One call of the service (→ commit), in-progress acks sent while it runs;
/// a panic fails it like an error, and is counted.
async fn call<S>(
    shared: &Shared,
    service: S,
    message: &jetstream::Message,
    delivery: &Delivery,
) -> Result<Outcome, BoxError>
where
    S: Service<Delivery, Response = Outcome>,
    S::Error: Into<BoxError>,
{
    let attempt = service.oneshot(delivery.clone());
    let call = async move { attempt.await.map_err(Into::into) };
    match running(panics::catch(call), &[message], &shared.config).await {
        Ok(result) => result,
        Err(panicked) => {
            panics::count(&delivery.info().consumer, delivery.event_type().as_str());
            Err(BoxError::from(panicked))
        }
    }
}

/// An ordered consumer's pause before it tries a failed delivery again in
/// place, in-progress acks sent meanwhile. False if shutdown came first: the
/// retry is left to the next leader.
async fn wait_in_place(
    shared: &Shared,
    message: &jetstream::Message,
    delivery: &Delivery,
    delay: Duration,
    stopping: &mut watch::Receiver<bool>,
) -> bool {
    let wait = async {
        tokio::select! {
            () = tokio::time::sleep(delay) => true,
            _ = stopping.wait_for(|stop| *stop) => false,
        }
    };
    if with_progress(wait, message, &shared.config).await {
        return true;
    }
    let info = delivery.info();
    tracing::info!(
        consumer = %info.consumer, event_id = %delivery.id(), stream_sequence = info.stream_sequence,
        "shutting down: the retry is left to the next leader",
    );
    false
}

/// Carries out `decision` on the message: ack (after commit), nak, dead
/// letter, or leave it. Returns whether the message is finished.
async fn settle(
    shared: &Shared,
    message: &jetstream::Message,
    delivery: &Delivery,
    attempt: u64,
    result: Result<Outcome, BoxError>,
    decision: Decision,
) -> bool {
    let info = delivery.info();
    match decision {
        Decision::Ack(_) => {
            // The transaction has committed: only now is the message acked.
            if let Err(e) = ack::send(message, AckKind::Ack, shared.config.ack_timeout).await {
                tracing::warn!(
                    consumer = %info.consumer, event_id = %delivery.id(), stream_sequence = info.stream_sequence,
                    error = %e,
                    "ack failed after commit; the redelivery will be a duplicate",
                );
            }
            true
        }
        Decision::Unrouted => {
            ack_unrouted(shared, message, delivery).await;
            true
        }
        Decision::Nak(delay) => {
            log_failure(delivery, attempt, &result, Next::Redelivery(delay));
            nak(message, info, delay, &shared.config).await;
            false
        }
        Decision::DeadLetter(reason) => {
            if let Some(panicked) = panicked(&result) {
                log_panic(delivery, attempt, panicked, Next::DeadLetter);
            }
            let error = result
                .err()
                .map(|e| error_chain(e.as_ref()))
                .unwrap_or_default();
            dead_letter(
                shared,
                message,
                info,
                Some(delivery.id()),
                reason,
                error,
                None,
            )
            .await
        }
        Decision::Abandon => {
            tracing::info!(
                consumer = %info.consumer, event_id = %delivery.id(), stream_sequence = info.stream_sequence,
                "another replica leads now: rolled back, left for it",
            );
            false
        }
    }
}

/// Acks a message no route handles, counted, without an effect.
async fn ack_unrouted(shared: &Shared, message: &jetstream::Message, delivery: &Delivery) {
    let info = delivery.info();
    let event_type = delivery.event_type().as_str();
    metrics::counter!(
        names::UNROUTED,
        "consumer" => info.consumer.clone(),
        "event_type" => event_type.to_owned(),
    )
    .increment(1);
    tracing::debug!(
        consumer = %info.consumer, event_id = %delivery.id(), event_type = %event_type,
        "no route for this event type: acked without an effect",
    );
    if let Err(e) = ack::send(message, AckKind::Ack, shared.config.ack_timeout).await {
        tracing::warn!(
            consumer = %info.consumer, event_id = %delivery.id(), error = %e,
            "ack of an unrouted message failed; it will be redelivered",
        );
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
        None,
    )
    .await
}

/// Records a dead letter (with the header block as stored, when no client
/// could read it), then terminates the message; if recording fails, naks it
/// so that dead-lettering is tried again. Returns whether it was recorded.
pub(crate) async fn dead_letter(
    shared: &Shared,
    message: &jetstream::Message,
    info: &DeliveryInfo,
    event_id: Option<EventId>,
    reason: Reason,
    error: String,
    raw_headers: Option<&[u8]>,
) -> bool {
    let letter = DeadLetter {
        info,
        event_id,
        reason,
        error,
        headers: message.headers.as_ref(),
        payload: &message.payload,
        raw_headers,
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

/// How long a service call may run before it is logged as still running
/// (and again each time as long again): the default idle-in-transaction
/// timeout of [`Timeouts`](crate::dedupe::Timeouts), past which a handler
/// that waits on something else than its database has lost its transaction.
pub(crate) const STILL_RUNNING_AFTER: Duration = Duration::from_secs(60);

/// Runs `fut`, sending an in-progress ack for each of `messages` every
/// `progress_every` until it finishes.
pub(crate) async fn with_progress_all<F: Future>(
    fut: F,
    messages: &[&jetstream::Message],
    config: &ConsumerConfig,
) -> F::Output {
    keep_while(fut, messages, config, None).await
}

/// [`with_progress_all`] for a service call: one that runs longer than
/// [`STILL_RUNNING_AFTER`] is logged at warn, with its messages' stream
/// sequences, and again each time it has run as long again, so that a hung
/// handler, whose messages the in-progress acks keep from every other
/// replica, does not hold them silently.
pub(crate) async fn running<F: Future>(
    fut: F,
    messages: &[&jetstream::Message],
    config: &ConsumerConfig,
) -> F::Output {
    keep_while(fut, messages, config, Some(STILL_RUNNING_AFTER)).await
}

async fn keep_while<F: Future>(
    fut: F,
    messages: &[&jetstream::Message],
    config: &ConsumerConfig,
    warn_every: Option<Duration>,
) -> F::Output {
    let every = config.progress_every();
    let started = Instant::now();
    let mut ticks = tokio::time::interval_at(started + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut overdue = warn_every.map(|after| Overdue::new(started, after));
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
                if overdue.as_mut().is_some_and(|o| o.due(Instant::now())) {
                    still_running(messages, config, started.elapsed());
                }
            }
        }
    }
}

/// When a running call is next reported as still running: once it has run
/// `after`, then each time it has run as long again.
#[derive(Debug)]
struct Overdue {
    after: Duration,
    next: Instant,
}

impl Overdue {
    fn new(started: Instant, after: Duration) -> Self {
        Self {
            after,
            next: started + after,
        }
    }

    /// Whether a report is due at `now`; if so, the next is one `after` on
    /// (never two at once after a long stall).
    fn due(&mut self, now: Instant) -> bool {
        if now < self.next {
            return false;
        }
        while self.next <= now {
            self.next += self.after.max(Duration::from_millis(1));
        }
        true
    }
}

/// The warning of a service call still running after `elapsed`.
fn still_running(messages: &[&jetstream::Message], config: &ConsumerConfig, elapsed: Duration) {
    let sequences: Vec<u64> = messages
        .iter()
        .filter_map(|m| m.info().ok().map(|i| i.stream_sequence))
        .collect();
    tracing::warn!(
        consumer = %config.durable, stream_sequences = ?sequences, running = ?elapsed,
        "a handler is still running: its messages are kept from redelivery (in-progress acks) \
         for as long as it runs; a hung handler holds them until its process stops",
    );
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

/// Why an attempt failed, as its log line tells it.
#[derive(Debug)]
enum Failure<'a> {
    /// The service call panicked.
    Panicked(&'a Panicked),
    /// The role lacks a privilege (SQLSTATE 42501): retried until it is
    /// granted, never dead-lettered.
    Refused(&'a BoxError),
    /// Anything else.
    Failed(&'a BoxError),
}

impl<'a> Failure<'a> {
    /// The failure of `result`; `None` if it succeeded.
    fn of(result: &'a Result<Outcome, BoxError>) -> Option<Self> {
        let error = result.as_ref().err()?;
        Some(if let Some(panicked) = error.downcast_ref::<Panicked>() {
            Self::Panicked(panicked)
        } else if outbox_pg::is_insufficient_privilege(error.as_ref()) {
            Self::Refused(error)
        } else {
            Self::Failed(error)
        })
    }
}

/// The runtime's one line for a failed attempt that will be tried again
/// (`next`: in place, or by redelivery).
fn log_failure(delivery: &Delivery, attempt: u64, result: &Result<Outcome, BoxError>, next: Next) {
    let info = delivery.info();
    let (event_id, event_type) = (delivery.id(), delivery.event_type());
    let in_place = matches!(next, Next::InPlace(_));
    let (Next::InPlace(delay) | Next::Redelivery(delay)) = next else {
        return;
    };
    match Failure::of(result) {
        None => {}
        Some(Failure::Panicked(panicked)) => log_panic(delivery, attempt, panicked, next),
        Some(Failure::Refused(error)) if in_place => tracing::error!(
            consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
            stream_sequence = info.stream_sequence, attempt, retry_in = ?delay, error = %error,
            "the consumer's database role lacks a privilege: rolled back, retried in place until it is granted (never dead-lettered)",
        ),
        Some(Failure::Refused(error)) => tracing::error!(
            consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
            stream_sequence = info.stream_sequence, retry_in = ?delay, error = %error,
            "the consumer's database role lacks a privilege: rolled back, redelivered until it is granted (never dead-lettered)",
        ),
        Some(Failure::Failed(error)) if in_place => tracing::warn!(
            consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
            subject = delivery.subject(), stream_sequence = info.stream_sequence,
            attempt, retry_in = ?delay, error = %error,
            "delivery failed and rolled back; retried in place, its subject waits",
        ),
        Some(Failure::Failed(error)) => tracing::warn!(
            consumer = %info.consumer, event_id = %event_id, event_type = %event_type,
            subject = delivery.subject(), stream_sequence = info.stream_sequence, delivered = info.delivered,
            retry_in = ?delay, error = %error,
            "delivery failed and rolled back; it will be redelivered",
        ),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_call_is_reported_after_a_minute_then_every_minute() {
        let started = Instant::now();
        let at = |secs: u64| started + Duration::from_secs(secs);
        let mut overdue = Overdue::new(started, STILL_RUNNING_AFTER);
        assert!(!overdue.due(at(1)));
        assert!(!overdue.due(at(59)));
        assert!(overdue.due(at(60)));
        assert!(!overdue.due(at(61)));
        assert!(!overdue.due(at(119)));
        assert!(overdue.due(at(120)));
        // After a stall of several minutes, one report, then a minute on.
        assert!(overdue.due(at(400)));
        assert!(!overdue.due(at(401)));
        assert!(overdue.due(at(420)));
    }

    #[tokio::test]
    async fn a_failure_is_told_apart_as_a_panic_or_an_error() {
        // A refusal (SQLSTATE 42501) needs a server to raise it: tests/tests/roles/grants.rs.

        let ok: Result<Outcome, BoxError> = Ok(Outcome::Handled);
        assert!(Failure::of(&ok).is_none());

        let panicked = panics::catch(async { panic!("boom") }).await.unwrap_err();
        let result: Result<Outcome, BoxError> = Err(BoxError::from(panicked));
        match Failure::of(&result) {
            Some(Failure::Panicked(p)) => assert_eq!(p.message(), "boom"),
            other => panic!("not a panic: {other:?}"),
        }

        let result: Result<Outcome, BoxError> = Err(BoxError::from(sqlx::Error::PoolTimedOut));
        assert!(matches!(Failure::of(&result), Some(Failure::Failed(_))));
    }

    #[test]
    fn the_error_chain_names_each_cause_once() {
        let inner = crate::Error::database("inserting the inbox row", sqlx::Error::PoolTimedOut);
        let outer = crate::HandlerError::retry(inner);
        let text = error_chain(&outer);
        assert!(
            text.starts_with("handler failed: inserting the inbox row: "),
            "{text}"
        );
        assert_eq!(
            text.matches("pool timed out").count(),
            1,
            "a cause its wrapper already shows is not repeated: {text}"
        );
    }
}
