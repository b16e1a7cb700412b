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
//! By default, within one process, the deliveries of one subject are handled
//! one at a time in the order JetStream delivers them, which is stream order
//! for first deliveries. Two things reorder: a failed delivery is nak'ed and
//! the subject's next message is handled before its redelivery arrives; and
//! replicas sharing a durable each handle their own share of a subject's
//! messages, at the same time. A handler for which order matters then either
//! compares event times through the inbox
//! ([`SkipStale`](crate::ordering::SkipStale)), as the contract's rule 3 asks,
//! or the consumer runs ordered.
//!
//! # Ordered consumption
//!
//! With [`ConsumerConfig::ordered`], no two events of one subject are ever
//! handled at once across all replicas of the durable, and each subject's
//! events are applied in stream order, through failures, crashes and
//! failovers:
//!
//! - **One leader.** Replicas compete for a session-level advisory lock on a
//!   database connection of their own; the holder leads and is the only one
//!   that pulls, the others stand by and try again every
//!   `lease_timeout / 50` (at most 250 ms). The server releases the lock when the
//!   leader's process dies (its socket closes) or its session stays silent for
//!   [`lease_timeout`](ConsumerConfig::lease_timeout) (frozen, cut off); a
//!   leader that cannot confirm its session steps down by itself.
//! - **Fenced commits.** Each new leader bumps an epoch in `inbox_leases`;
//!   [`Dedupe`](crate::Dedupe) checks it just before every commit, under a lock
//!   the bump takes exclusively. A deposed leader's transactions roll back
//!   ([`ErrorKind::LeaseLost`](crate::ErrorKind::LeaseLost)) and their messages
//!   are left to the new leader.
//! - **Pulls end with the lead.** A leader pulls one 500 ms batch at a time,
//!   and only while its session was confirmed (pinged every 250 ms) in the
//!   last second.
//! - **Takeover.** A new leader whose predecessor did not let go cleanly waits
//!   1.75 s for the predecessor's last pull to expire. Then it reads the stream
//!   between the consumer's ack floor and its last delivered message, keeps
//!   the events its inbox has neither handled nor dead-lettered, and, per
//!   subject, handles those first, in stream order, as JetStream redelivers
//!   them (after `ack_wait`), holding later events of the same subject back
//!   (with in-progress acks). Other subjects go on at once. If an unfinished
//!   event never comes back (twice the longest redelivery delay, plus 10 s),
//!   its subject goes on without it and an error names it.
//! - **In-place retries.** A failed delivery is retried by the leader after
//!   the [`RetryPolicy`] delay, keeping its subject busy, instead of being
//!   nak'ed past; the last allowed attempt is dead-lettered as usual.
//!
//! The cost is throughput: one process handles the whole consumer (up to
//! `concurrency` subjects at once), however many replicas run; the others are
//! hot standbys. A crashed leader's subjects in flight resume after the
//! failover (up to 250 ms to notice, 1.75 s, then `ack_wait` for the
//! unfinished events to come back); the other subjects after the first two. All replicas of a durable must agree on
//! the setting; it needs PostgreSQL 14 or later (`idle_session_timeout`).

pub(crate) mod ack;
mod config;
mod dispatch;
pub(crate) mod lease;
mod process;
mod takeover;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use futures::StreamExt;
use outbox_core::EventId;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::Service;

use crate::delivery::{Delivery, Outcome};
use crate::error::{BoxError, Error, Result};
use crate::retention;

pub use crate::retry::RetryPolicy;
pub use config::ConsumerConfig;

use dispatch::Dispatcher;
use lease::Tenure;
use process::Shared;
use takeover::Backlog;

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
/// messages (or, [`ordered`](ConsumerConfig::ordered), one leads and the
/// others stand by), the inbox keeps one effect per event.
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
    /// call), so every layer sees tower's usual contract. An
    /// [`ordered`](ConsumerConfig::ordered) consumer first waits to lead (or
    /// for `shutdown`), and goes back to standing by if it loses the lead.
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
        let shared = Arc::clone(&self.shared);
        let config = &shared.config;
        let _pruner = config
            .prune
            .then(|| AbortOnDrop(tokio::spawn(prune_periodically(Arc::clone(&shared)))));
        let mut shutdown = std::pin::pin!(shutdown);
        tracing::info!(
            consumer = %config.durable, stream = %config.stream, concurrency = config.concurrency,
            ordered = config.ordered, "inbox consumer started",
        );
        if config.ordered {
            loop {
                let tenure = tokio::select! {
                    biased;
                    () = shutdown.as_mut() => break,
                    tenure = lease::acquire(&shared.pool, &config.durable, config.lease_timeout) => tenure,
                };
                match self
                    .serve(service.clone(), shutdown.as_mut(), Some(tenure))
                    .await
                {
                    Served::Shutdown(tenure) => {
                        if let Some(tenure) = tenure {
                            tenure.release().await;
                        }
                        break;
                    }
                    Served::Deposed => {}
                }
            }
        } else {
            self.serve(service, shutdown.as_mut(), None).await;
        }
        tracing::info!(consumer = %config.durable, "inbox consumer stopped");
        Ok(())
    }

    /// Fetches and handles messages until `shutdown` (then drains) or, when
    /// leading, until the lead is lost (then drops everything it holds: the new
    /// leader gets it all back from JetStream).
    async fn serve<S, F>(
        &self,
        service: S,
        mut shutdown: Pin<&mut F>,
        mut tenure: Option<Tenure>,
    ) -> Served
    where
        S: Service<Delivery, Response = Outcome> + Clone + Send + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
        F: Future<Output = ()> + Send,
    {
        let shared = &self.shared;
        let config = &shared.config;
        let mut backlog: Backlog<Job> = Backlog::default();
        if let Some(lead) = &tenure
            && !lead.clean_handover()
        {
            // The previous leader may still have a pull open: let it expire.
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return Served::Shutdown(tenure),
                () = lost(&mut tenure) => return Served::Deposed,
                () = tokio::time::sleep(lease::takeover_wait()) => {}
            }
        }
        if tenure.is_some() {
            // Before fetching anything: what did earlier leaders leave unfinished?
            loop {
                tokio::select! {
                    biased;
                    () = shutdown.as_mut() => return Served::Shutdown(tenure),
                    () = lost(&mut tenure) => return Served::Deposed,
                    scanned = takeover::scan(shared, &self.consumer) => match scanned {
                        Ok(found) => {
                            backlog = found;
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(consumer = %config.durable, error = %e, "cannot read what earlier leaders left; retrying");
                        }
                    },
                }
                tokio::time::sleep(REOPEN_DELAY).await;
            }
        }
        let epoch = tenure.as_ref().map(Tenure::epoch);
        let mut messages: Option<Messages> = None;
        let mut reopen_at = Instant::now();
        let mut tasks: JoinSet<bool> = JoinSet::new();
        let mut keys: TaskKeys = HashMap::new();
        let mut dispatcher: Dispatcher<Job> = Dispatcher::new();
        // Jobs cleared to run, in arrival order, waiting for a free slot.
        let mut ready: VecDeque<Job> = VecDeque::new();
        let mut progress_at = Instant::now() + config.progress_every();
        let mut stopping = false;
        // Tells in-place retries to give up at shutdown.
        let (stop, stop_rx) = watch::channel(false);

        loop {
            while tasks.len() < config.concurrency
                && let Some(job) = ready.pop_front()
            {
                let key = job.1.subject().to_owned();
                if let Some(job) = dispatcher.offer(&key, job) {
                    spawn_delivery(
                        &mut tasks,
                        &mut keys,
                        (shared, &service, &stop_rx),
                        key,
                        job,
                    );
                }
            }
            if stopping && tasks.is_empty() {
                break;
            }
            let room = !stopping
                && ready.is_empty()
                && tasks.len() < config.concurrency
                && tasks.len() + dispatcher.queued() < config.max_buffered
                && tenure.as_ref().is_none_or(Tenure::valid);
            if room && messages.is_none() && Instant::now() >= reopen_at {
                match Messages::open(&self.consumer, config).await {
                    Ok(opened) => messages = Some(opened),
                    Err(e) => {
                        tracing::warn!(consumer = %config.durable, error = %e, "cannot open the message stream; retrying");
                        reopen_at = Instant::now() + REOPEN_DELAY;
                    }
                }
            }
            tokio::select! {
                biased;
                () = shutdown.as_mut(), if !stopping => {
                    tracing::info!(
                        consumer = %config.durable, in_flight = tasks.len(), queued = dispatcher.queued(),
                        "shutting down: fetching stopped, finishing held messages",
                    );
                    stopping = true;
                    messages = None;
                    let _ = stop.send(true);
                }
                () = lost(&mut tenure), if tenure.is_some() => {
                    tracing::warn!(
                        consumer = %config.durable, in_flight = tasks.len(), queued = dispatcher.queued() + ready.len(),
                        "lost the lead: dropping every held message for the new leader",
                    );
                    // Dropping the tasks aborts them: their transactions roll back.
                    return if stopping { Served::Shutdown(None) } else { Served::Deposed };
                }
                Some(joined) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                    let (id, finished) = match joined {
                        Ok((id, finished)) => (id, finished),
                        Err(e) => {
                            tracing::error!(
                                consumer = %config.durable, error = %e,
                                "a delivery task failed without acking; the message will be redelivered",
                            );
                            (e.id(), false)
                        }
                    };
                    if let Some(Some((key, event))) = keys.remove(&id) {
                        if let Some(job) = dispatcher.finish(&key) {
                            spawn_delivery(&mut tasks, &mut keys, (shared, &service, &stop_rx), key.clone(), job);
                        }
                        if finished {
                            ready.extend(backlog.finished(&key, event));
                        }
                    }
                }
                next = next_message(&mut messages), if room && messages.is_some() => match next {
                    Some(Ok(message)) => match Delivery::from_message(&message) {
                        Ok(delivery) => {
                            let delivery = match epoch {
                                Some(epoch) => delivery.with_leader_epoch(epoch),
                                None => delivery,
                            };
                            ready.extend(backlog.admit((message, delivery)));
                        }
                        Err(poison) => {
                            let handle = tasks.spawn(process::poison(Arc::clone(shared), message, poison));
                            keys.insert(handle.id(), None);
                        }
                    },
                    Some(Err(e)) if e.missed_heartbeat => {
                        // The stream recovers by itself (re-issues its pull).
                        tracing::debug!(consumer = %config.durable, error = %e.text, "missed heartbeat");
                    }
                    Some(Err(e)) => {
                        // Start over with a fresh stream, after a pause, so a
                        // broker outage is not a hot loop.
                        tracing::warn!(consumer = %config.durable, error = %e.text, "message stream failed; reopening");
                        messages = None;
                        reopen_at = Instant::now() + REOPEN_DELAY;
                    }
                    None => {
                        // A leader's batch ends after each pull; a plain stream only when it breaks.
                        tracing::trace!(consumer = %config.durable, "message stream ended; reopening");
                        messages = None;
                        reopen_at = if config.ordered { Instant::now() } else { Instant::now() + REOPEN_DELAY };
                    }
                },
                () = tokio::time::sleep_until(reopen_at), if room && messages.is_none() => {}
                () = tokio::time::sleep_until(progress_at), if !backlog.is_empty() => {
                    // Held-back messages keep their place with in-progress acks.
                    let held: Vec<jetstream::Message> = backlog.held().map(|job| job.0.clone()).collect();
                    let timeout = config.ack_timeout;
                    tokio::spawn(async move {
                        for message in held {
                            if let Err(e) = ack::send(&message, AckKind::Progress, timeout).await {
                                tracing::debug!(error = %e, "in-progress ack of a held message failed");
                            }
                        }
                    });
                    ready.extend(backlog.expire(&config.durable, Instant::now()));
                    progress_at = Instant::now() + config.progress_every();
                }
            }
        }
        Served::Shutdown(tenure)
    }
}

/// How [`Consumer::serve`] ended.
enum Served {
    /// Shut down and drained; the tenure, if still leading, to release.
    Shutdown(Option<Tenure>),
    /// The lead was lost: stand by again.
    Deposed,
}

type Job = (jetstream::Message, Delivery);
/// Each delivery task's subject and event, to free the subject when it ends.
type TaskKeys = HashMap<tokio::task::Id, Option<(String, EventId)>>;

/// Starts the delivery task of `job`, remembering its subject key.
fn spawn_delivery<S>(
    tasks: &mut JoinSet<bool>,
    keys: &mut TaskKeys,
    (shared, service, stopping): (&Arc<Shared>, &S, &watch::Receiver<bool>),
    key: String,
    (message, delivery): Job,
) where
    S: Service<Delivery, Response = Outcome> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    let event = delivery.id();
    let handle = tasks.spawn(process::deliver(
        Arc::clone(shared),
        service.clone(),
        message,
        delivery,
        stopping.clone(),
    ));
    keys.insert(handle.id(), Some((key, event)));
}

/// Where messages come from: a long-lived pull stream, or, for a leader, one
/// pull at a time so that each is issued only while the lead is confirmed.
enum Messages {
    Stream(jetstream::consumer::pull::Stream),
    Batch(jetstream::consumer::pull::Batch),
}

/// A failed read from [`Messages`].
struct FetchError {
    missed_heartbeat: bool,
    text: String,
}

impl Messages {
    async fn open(consumer: &PullConsumer, config: &ConsumerConfig) -> Result<Self, BoxError> {
        if config.ordered {
            // Short pulls, issued only while the lead is confirmed: none
            // outlives a deposed leader by more than this.
            let batch = consumer
                .batch()
                .max_messages(config.batch)
                .expires(lease::PULL_EXPIRES)
                .messages()
                .await?;
            return Ok(Self::Batch(batch));
        }
        let stream = consumer
            .stream()
            .max_messages_per_batch(config.batch)
            .heartbeat(HEARTBEAT)
            .expires(PULL_EXPIRES)
            .messages()
            .await?;
        Ok(Self::Stream(stream))
    }
}

async fn next_message(
    messages: &mut Option<Messages>,
) -> Option<Result<jetstream::Message, FetchError>> {
    use jetstream::consumer::pull::MessagesErrorKind;
    match messages {
        Some(Messages::Stream(stream)) => stream.next().await.map(|next| {
            next.map_err(|e| FetchError {
                missed_heartbeat: e.kind() == MessagesErrorKind::MissingHeartbeat,
                text: e.to_string(),
            })
        }),
        Some(Messages::Batch(batch)) => batch.next().await.map(|next| {
            next.map_err(|e| FetchError {
                missed_heartbeat: false,
                text: e.to_string(),
            })
        }),
        None => std::future::pending().await,
    }
}

/// Resolves when a held tenure is lost; never without one.
async fn lost(tenure: &mut Option<Tenure>) {
    match tenure {
        Some(tenure) => tenure.lost().await,
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
