//! The runtime: a JetStream durable pull consumer driving a service stack.
//!
//! Per message: decode → begin → layers → handler → commit → ack.
//!
//! - **Ack only after commit.** The stack's future resolves once
//!   [`Dedupe`](crate::dedupe::Dedupe) has committed; only then is the message
//!   acked (`double_ack`, confirmed by the server). A failed commit is an error,
//!   and an error is never acked: it is nak'ed and redelivered.
//! - **Errors** roll back; [`HandlerError`](crate::HandlerError) decides
//!   between a nak whose delay grows with the delivery count
//!   ([`RetryPolicy`]) and a reject:
//!
//!   | result | JetStream |
//!   | --- | --- |
//!   | `Ok(Handled / Duplicate / Stale)` (committed) | `+ACK`, confirmed (`double_ack`) |
//!   | retryable error (rolled back) | `-NAK {delay}` |
//!   | retryable error on the last allowed delivery | dead letter (`max_deliveries`), `+TERM` |
//!   | reject, undecodable payload, no route | dead letter, `+TERM` |
//!   | an error type this crate does not know (a third-party layer) | retried |
//! - **Poison** (not JSON, not a CloudEvent, no valid id, undecodable payload,
//!   no route, a reject, or the last allowed delivery failing) is written to
//!   `inbox_dead_letters` (and the DLQ subject, if configured) and terminated.
//!   The consumer goes on; nothing is dropped silently.
//! - **Concurrency.** Up to [`ConsumerConfig::concurrency`] deliveries run at
//!   once, but never two of one envelope subject: later messages of a busy
//!   subject wait, in arrival order, until it frees. Fetching pauses while all
//!   slots are taken or [`ConsumerConfig::max_buffered`] messages are held.
//! - **Long handlers** get an in-progress ack every
//!   [`ConsumerConfig::progress_interval`]. Messages *queued* behind a busy
//!   subject get none: if they wait longer than `ack_wait`, JetStream redelivers
//!   them, the copy queues behind the original, and the inbox makes it a
//!   duplicate, but each such wait counts toward `max_deliver`. Keep
//!   `ack_wait` well above a subject's backlog × handler time.
//! - **Broker outages**: a failed message stream is reopened after a pause;
//!   ack failures are logged (the redelivery will be a duplicate).
//! - **Shutdown.** When the shutdown future resolves, fetching stops, and every
//!   message already held (running or queued) is finished, committed and acked
//!   before [`Consumer::run`] returns. Dropping the `run` future instead aborts
//!   everything in flight without acking, like a crash: those messages are
//!   redelivered after `ack_wait` and the inbox turns any committed one into a
//!   duplicate.
//!
//! # Ordering guarantee
//!
//! Within one process, the deliveries of one subject are handled one at a time
//! in the order JetStream delivers them, which is stream order for first
//! deliveries. Two things reorder: a failed delivery is nak'ed and the
//! subject's next message is handled before its redelivery arrives; and
//! replicas sharing a durable each handle their own share of a subject's
//! messages. A handler for which order matters compares event times through
//! the inbox ([`SkipStale`](crate::ordering::SkipStale)), as the contract's
//! rule 3 asks.

pub(crate) mod ack;
mod config;
mod dispatch;
mod process;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use sqlx::PgPool;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::Service;

use crate::delivery::{Delivery, Outcome};
use crate::error::{BoxError, Error, Result};
use crate::retention;

pub use ack::RetryPolicy;
pub use config::ConsumerConfig;

use dispatch::Dispatcher;
use process::Shared;

/// How long to wait before re-opening a failed message stream.
const REOPEN_DELAY: Duration = Duration::from_secs(1);
/// Idle heartbeat of a pull request: a broker restart is noticed after two missed ones.
const HEARTBEAT: Duration = Duration::from_secs(2);
/// Lifetime of one pull request.
const PULL_EXPIRES: Duration = Duration::from_secs(10);

/// A durable pull consumer bound to a database: the runtime of the inbox.
///
/// Build it with [`Consumer::new`], then [`run`](Consumer::run) a service stack
/// on it. Several processes may run the same durable: JetStream shares the
/// messages, the inbox keeps one effect per event.
#[derive(Debug)]
pub struct Consumer {
    shared: Arc<Shared>,
    consumer: PullConsumer,
}

impl Consumer {
    /// Creates the durable consumer on the stream, or updates it to `config`,
    /// and checks the inbox retention window against its redelivery window.
    ///
    /// # Errors
    /// [`ErrorKind::Nats`](crate::ErrorKind::Nats) if the stream is missing or
    /// the consumer cannot be created;
    /// [`ErrorKind::Config`](crate::ErrorKind::Config) if the retention window
    /// is shorter than `max_deliver` redeliveries (see [`crate::retention`] and
    /// [`check_window`](crate::retention::check_window)).
    pub async fn new(js: jetstream::Context, pool: PgPool, config: ConsumerConfig) -> Result<Self> {
        let stream = js
            .get_stream(&config.stream)
            .await
            .map_err(|e| Error::nats(&format!("looking up stream `{}`", config.stream), e))?;
        let consumer: PullConsumer =
            stream
                .create_consumer(config.pull_config())
                .await
                .map_err(|e| {
                    Error::nats(
                        &format!(
                            "creating durable consumer `{}` on `{}`",
                            config.durable, config.stream
                        ),
                        e,
                    )
                })?;
        let server = &consumer.cached_info().config;
        let redelivery = retention::redelivery_window(
            server.ack_wait,
            server.max_deliver,
            &server.backoff,
            &config.retry,
        );
        retention::check_window(config.retention.get_window(), redelivery)?;
        let max_deliver = server.max_deliver;
        Ok(Self {
            shared: Arc::new(Shared {
                js,
                pool,
                config,
                max_deliver,
            }),
            consumer,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ConsumerConfig {
        &self.shared.config
    }

    /// Runs `service` on every message until `shutdown` resolves, then drains.
    ///
    /// `service` is cloned per message and driven with `oneshot` (ready, then
    /// call), so every layer sees tower's usual contract.
    ///
    /// # Errors
    /// None today: fetch and ack failures are logged and retried, and handler
    /// failures are acked, nak'ed or dead-lettered per message. The `Result` is
    /// kept for start-up failures a future version may report.
    pub async fn run<S, F>(self, service: S, shutdown: F) -> Result<()>
    where
        S: Service<Delivery, Response = Outcome> + Clone + Send + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
        F: Future<Output = ()> + Send,
    {
        let shared = self.shared;
        let config = &shared.config;
        let _pruner = config
            .prune
            .then(|| AbortOnDrop(tokio::spawn(prune_periodically(Arc::clone(&shared)))));
        let mut shutdown = std::pin::pin!(shutdown);
        let mut messages = None;
        let mut reopen_at = Instant::now();
        let mut tasks: JoinSet<()> = JoinSet::new();
        let mut keys: TaskKeys = HashMap::new();
        let mut dispatcher: Dispatcher<Job> = Dispatcher::new();
        let mut stopping = false;
        tracing::info!(
            consumer = %config.durable, stream = %config.stream, concurrency = config.concurrency,
            "inbox consumer started",
        );

        loop {
            if stopping && tasks.is_empty() {
                break;
            }
            let room = !stopping
                && tasks.len() < config.concurrency
                && tasks.len() + dispatcher.queued() < config.max_buffered;
            if room && messages.is_none() && Instant::now() >= reopen_at {
                match self
                    .consumer
                    .stream()
                    .max_messages_per_batch(config.batch)
                    .heartbeat(HEARTBEAT)
                    .expires(PULL_EXPIRES)
                    .messages()
                    .await
                {
                    Ok(stream) => messages = Some(stream),
                    Err(e) => {
                        tracing::warn!(consumer = %config.durable, error = %e, "cannot open the message stream; retrying");
                        reopen_at = Instant::now() + REOPEN_DELAY;
                    }
                }
            }
            tokio::select! {
                biased;
                () = &mut shutdown, if !stopping => {
                    tracing::info!(
                        consumer = %config.durable, in_flight = tasks.len(), queued = dispatcher.queued(),
                        "shutting down: fetching stopped, finishing held messages",
                    );
                    stopping = true;
                    messages = None;
                }
                Some(joined) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                    let id = match joined {
                        Ok((id, ())) => id,
                        Err(e) => {
                            tracing::error!(
                                consumer = %config.durable, error = %e,
                                "a delivery task failed without acking; the message will be redelivered",
                            );
                            e.id()
                        }
                    };
                    if let Some(Some(key)) = keys.remove(&id)
                        && let Some(job) = dispatcher.finish(&key)
                    {
                        spawn_delivery(&mut tasks, &mut keys, &shared, &service, key, job);
                    }
                }
                next = next_message(&mut messages), if room && messages.is_some() => match next {
                    Some(Ok(message)) => match Delivery::from_message(&message) {
                        Ok(delivery) => {
                            let key = delivery.subject().to_owned();
                            if let Some(job) = dispatcher.offer(&key, (message, delivery)) {
                                spawn_delivery(&mut tasks, &mut keys, &shared, &service, key, job);
                            }
                        }
                        Err(poison) => {
                            let handle = tasks.spawn(process::poison(Arc::clone(&shared), message, poison));
                            keys.insert(handle.id(), None);
                        }
                    },
                    Some(Err(e)) => {
                        use jetstream::consumer::pull::MessagesErrorKind as Kind;
                        match e.kind() {
                            // The stream recovers by itself (re-issues its pull).
                            Kind::MissingHeartbeat => {
                                tracing::debug!(consumer = %config.durable, error = %e, "missed heartbeat");
                            }
                            // Anything else: start over with a fresh stream, after a pause,
                            // so a broker outage is not a hot loop.
                            _ => {
                                tracing::warn!(consumer = %config.durable, error = %e, "message stream failed; reopening");
                                messages = None;
                                reopen_at = Instant::now() + REOPEN_DELAY;
                            }
                        }
                    }
                    None => {
                        tracing::debug!(consumer = %config.durable, "message stream ended; reopening");
                        messages = None;
                        reopen_at = Instant::now() + REOPEN_DELAY;
                    }
                },
                () = tokio::time::sleep_until(reopen_at), if room && messages.is_none() => {}
            }
        }
        tracing::info!(consumer = %config.durable, "inbox consumer stopped");
        Ok(())
    }
}

type Job = (jetstream::Message, Delivery);
type TaskKeys = HashMap<tokio::task::Id, Option<String>>;

/// Starts the delivery task of `job`, remembering its subject key.
fn spawn_delivery<S>(
    tasks: &mut JoinSet<()>,
    keys: &mut TaskKeys,
    shared: &Arc<Shared>,
    service: &S,
    key: String,
    (message, delivery): Job,
) where
    S: Service<Delivery, Response = Outcome> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    let handle = tasks.spawn(process::deliver(
        Arc::clone(shared),
        service.clone(),
        message,
        delivery,
    ));
    keys.insert(handle.id(), Some(key));
}

async fn next_message(
    messages: &mut Option<jetstream::consumer::pull::Stream>,
) -> Option<Result<jetstream::Message, jetstream::consumer::pull::MessagesError>> {
    match messages {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

async fn prune_periodically(shared: Arc<Shared>) {
    let retention = &shared.config.retention;
    let mut ticks = tokio::time::interval(retention.get_interval().max(Duration::from_secs(1)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match retention.prune(&shared.pool, &shared.config.durable).await {
            Ok(0) => {}
            Ok(deleted) => {
                tracing::info!(consumer = %shared.config.durable, deleted, "pruned inbox rows past retention");
            }
            Err(e) => {
                tracing::warn!(consumer = %shared.config.durable, error = %e, "inbox pruning failed");
            }
        }
    }
}

/// Aborts the task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
