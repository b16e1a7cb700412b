//! One serving session of the runtime: pull, hold, dispatch, keep alive, until
//! shutdown (then drain) or, for a leader, until the lead is lost.
//!
//! Everything the session holds is counted in `held`: messages received and
//! not yet finished, whether running in a task, cleared to run, waiting in
//! arrival order behind a busy subject, or held back behind an unfinished
//! event of a previous leader. A pull asks for no more than the room left
//! under [`max_buffered`](super::ConsumerConfig::max_buffered), so `held`
//! never exceeds it (except for messages held back after a takeover, which
//! must not stop the pulls that bring their predecessors back; they are
//! bounded by the backlog's expiry and by the consumer's `max_ack_pending`,
//! all the more when a takeover scan hit its bound and holds every
//! subject); and every held message that is not
//! running gets an in-progress ack each [`progress_interval`](super::ConsumerConfig::progress_interval)
//! (running ones get theirs from their task), so none is redelivered while
//! it waits.
//!
//! A leader also keeps its takeover [`Checkpoint`] (every message received,
//! and each finished) and records it every [`checkpoint::SAVE_EVERY`], and a
//! last time before it lets go at shutdown.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use futures::{FutureExt, StreamExt};
use outbox_pg::{Envelope, EventId};
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::{Id, JoinError, JoinSet};
use tokio::time::Instant;

use super::dispatch::Dispatcher;
use super::ghosts;
use super::ordered::checkpoint::{self, CaughtUp, Checkpoint, Position};
use super::ordered::gaps::Gaps;
use super::ordered::lease::{self, Tenure};
use super::ordered::takeover::{self, Backlog};
use super::panics;
use super::process::{self, Shared};
use super::runner::Runner;
use super::{Job, ack};
use crate::delivery::{Delivery, DeliveryInfo};
use crate::metrics::names;

/// How long to wait before pulling again after a failed pull.
const REPULL_DELAY: Duration = Duration::from_secs(1);
/// Lifetime of one pull request of a consumer that is not ordered. A pull
/// lost with a restarting broker is replaced after this plus 5 s.
const PULL_EXPIRES: Duration = Duration::from_secs(2);
/// How often a leader whose session is not confirmed checks again before pulling.
const UNCONFIRMED_RECHECK: Duration = Duration::from_millis(100);

/// How a session ended.
pub(crate) enum Served {
    /// Shut down and drained; the tenure, if still leading, to release.
    Shutdown(Option<Tenure>),
    /// The lead was lost: stand by again.
    Deposed,
    /// The NATS client is closed: nothing more can be pulled or acked. Every
    /// held message was dropped unacked (running deliveries rolled back);
    /// they come back after `ack_wait` to whoever pulls next.
    ClientClosed,
}

/// What a running task holds: one entry per job (subject, event), in order,
/// and the stream sequence of each message (a poison message, a replay for
/// another consumer or a message handed back holds one and no job).
#[derive(Default)]
struct Holding {
    /// Each job's envelope (shared with its delivery): its subject and event.
    jobs: Vec<Arc<Envelope<Value>>>,
    sequences: Vec<u64>,
}

type Tracked = HashMap<Id, Holding>;

/// The state of one session. See the [module docs](self).
pub(crate) struct Session<'a, R> {
    shared: &'a Arc<Shared>,
    consumer: &'a PullConsumer,
    runner: R,
    tenure: Option<Tenure>,
    /// Messages received and not finished.
    held: usize,
    /// Jobs admitted, in arrival order, not yet offered to the dispatcher.
    ready: VecDeque<Job>,
    /// Jobs whose subject the dispatcher already gave them: they start next.
    cleared: VecDeque<Job>,
    dispatcher: Dispatcher<Job>,
    backlog: Backlog<Job>,
    /// A leader's takeover checkpoint, and the recording of it in flight.
    checkpoint: Option<Checkpoint>,
    recording: Option<tokio::task::JoinHandle<Option<Position>>>,
    checkpoint_at: Instant,
    /// A frozen checkpoint's catch-up in flight, and when to try the next.
    catching_up: Option<tokio::task::JoinHandle<Result<CaughtUp, crate::Error>>>,
    catch_up_at: Instant,
    /// A leader's subjects with an event left unfinished while shutting down:
    /// none of their later events runs in this session, so none overtakes
    /// it. They go back unacked to the next leader.
    abandoned: HashSet<String>,
    tasks: JoinSet<Vec<bool>>,
    tracked: Tracked,
    pull: Option<jetstream::consumer::pull::Batch>,
    pull_at: Instant,
    progress_at: Instant,
    stopping: bool,
    /// A failed pull found the NATS client closed.
    client_closed: bool,
    /// A leader's deliveries that never arrived ([`gaps`]).
    gaps: Option<Gaps>,
    /// Tells in-place retries to give up at shutdown.
    stop: watch::Sender<bool>,
}

impl<'a, R: Runner> Session<'a, R> {
    pub(crate) fn new(
        shared: &'a Arc<Shared>,
        consumer: &'a PullConsumer,
        runner: R,
        tenure: Option<Tenure>,
        backlog: Backlog<Job>,
        checkpoint: Option<Checkpoint>,
    ) -> Self {
        let now = Instant::now();
        let gaps = tenure.is_some().then(Gaps::default);
        Self {
            shared,
            consumer,
            runner,
            tenure,
            held: 0,
            ready: VecDeque::new(),
            cleared: VecDeque::new(),
            dispatcher: Dispatcher::new(),
            backlog,
            checkpoint,
            recording: None,
            checkpoint_at: now + checkpoint::SAVE_EVERY,
            catching_up: None,
            catch_up_at: now + checkpoint::CATCH_UP_EVERY,
            abandoned: HashSet::new(),
            tasks: JoinSet::new(),
            tracked: HashMap::new(),
            pull: None,
            pull_at: now,
            progress_at: now + shared.config.progress_every(),
            stopping: false,
            client_closed: false,
            gaps,
            stop: watch::channel(false).0,
        }
    }

    /// Serves until `shutdown` resolves (then drains) or the lead is lost.
    pub(crate) async fn run<F: Future<Output = ()>>(mut self, mut shutdown: Pin<&mut F>) -> Served {
        loop {
            if self.client_closed {
                return self.client_gone().await;
            }
            self.take_arrived();
            self.start_jobs();
            if self.stopping && self.tasks.is_empty() && self.pull.is_none() {
                self.record_last_checkpoint().await;
                return Served::Shutdown(self.tenure.take());
            }
            let retry_pull = self.open_pull().await;
            tokio::select! {
                biased;
                () = shutdown.as_mut(), if !self.stopping => self.begin_shutdown(),
                () = lost(&mut self.tenure), if self.tenure.is_some() => return self.deposed(),
                Some(joined) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    self.task_ended(joined);
                }
                next = next_message(&mut self.pull), if self.pull.is_some() => self.received(next),
                () = tokio::time::sleep_until(self.pull_at), if retry_pull => {}
                () = tokio::time::sleep_until(self.progress_at) => self.keep_alive(),
                () = tokio::time::sleep_until(self.checkpoint_at), if self.checkpoint.is_some() => {
                    self.record_checkpoint();
                }
                explained = explained(&mut self.gaps) => self.gap_explained(explained),
            }
        }
    }

    /// Takes in what the open pull has already brought, without waiting for
    /// more: a slot that frees then starts a batch of everything that has
    /// arrived, not only of what the session happened to read before the
    /// task's end woke it.
    fn take_arrived(&mut self) {
        if self.pull.is_some()
            && let Some(next) = next_message(&mut self.pull).now_or_never()
        {
            self.received(next);
        }
    }

    /// Starts tasks for cleared and ready jobs while slots are free.
    fn start_jobs(&mut self) {
        let most = self.runner.max_jobs();
        while self.tasks.len() < self.shared.config.concurrency {
            let mut jobs = Vec::new();
            while jobs.len() < most
                && let Some(job) = self.cleared.pop_front()
            {
                jobs.push(job);
            }
            while jobs.len() < most
                && let Some(job) = self.ready.pop_front()
            {
                let envelope = job.1.shared_envelope();
                let key = envelope.subject();
                if self.abandoned.contains(key) {
                    self.held = self.held.saturating_sub(1);
                    continue;
                }
                if let Some(job) = self.dispatcher.offer(key, job) {
                    jobs.push(job);
                }
            }
            if jobs.is_empty() {
                return;
            }
            let keys = Holding {
                jobs: jobs.iter().map(|(_, d)| d.shared_envelope()).collect(),
                sequences: jobs.iter().map(|(_, d)| d.info().stream_sequence).collect(),
            };
            let stopping = self.stop.subscribe();
            let id = self
                .runner
                .spawn(&mut self.tasks, self.shared, jobs, stopping);
            self.tracked.insert(id, keys);
        }
    }

    /// Room for more messages under `max_buffered`. Messages held back behind
    /// a previous leader's unfinished events do not count: those events come
    /// back only through a pull, so they must never be what stops pulling
    /// (the backlog is bounded by its own expiry).
    fn room(&self) -> usize {
        let held_back = self.backlog.held().count();
        self.shared
            .config
            .max_buffered
            .saturating_sub(self.held.saturating_sub(held_back))
    }

    /// Issues a pull sized to the room left, when it is time and worth it.
    /// Returns whether to try again at `pull_at`; otherwise a task that ends
    /// (freeing room) or the pull in flight wakes the session.
    async fn open_pull(&mut self) -> bool {
        let config = &self.shared.config;
        if self.stopping || self.pull.is_some() {
            return false;
        }
        // Wait for room worth a pull, unless nothing at all is held.
        let worth = if self.held == 0 {
            1
        } else {
            (config.batch.min(config.max_buffered) / 2).max(1)
        };
        if self.room() < worth {
            return false;
        }
        if Instant::now() < self.pull_at {
            return true;
        }
        if let Some(tenure) = &self.tenure
            && !tenure.valid()
        {
            self.pull_at = Instant::now() + UNCONFIRMED_RECHECK;
            return true;
        }
        // Batched, enough for every slot's batch: a backlog then arrives
        // faster than batches start, so each takes a full one.
        let most = self.runner.max_jobs();
        let wanted = if most > 1 {
            most.saturating_mul(config.concurrency)
        } else {
            most
        };
        let size = self.room().min(config.batch.max(wanted));
        // A leader's pulls are short: none outlives a deposed leader by more
        // than `lease::PULL_EXPIRES`.
        let expires = if self.tenure.is_some() {
            lease::PULL_EXPIRES
        } else {
            PULL_EXPIRES
        };
        let pull = self
            .consumer
            .batch()
            .max_messages(size)
            .expires(expires)
            .messages();
        let error = match tokio::time::timeout(config.ack_timeout, pull).await {
            Ok(Ok(pull)) => {
                self.pull = Some(pull);
                return false;
            }
            Ok(Err(e)) => e.to_string(),
            Err(elapsed) => elapsed.to_string(),
        };
        if self.note_client_closed() {
            return false;
        }
        tracing::warn!(consumer = %config.durable, %error, "cannot pull messages; retrying");
        self.pull_at = Instant::now() + REPULL_DELAY;
        true
    }

    /// After a failed pull: whether the NATS client is closed for good
    /// (then the session ends at the top of its loop) rather than
    /// disconnected (then pulling again is right).
    fn note_client_closed(&mut self) -> bool {
        self.client_closed = outbox_pg::nats::is_closed(&self.shared.js.client());
        self.client_closed
    }

    /// Ends the session on a closed NATS client: every running delivery is
    /// aborted (its transaction rolls back) and every held message dropped
    /// unacked, as in a crash: JetStream redelivers them after `ack_wait`,
    /// and the inbox turns any effect already committed into a duplicate. A
    /// leader records its checkpoint first (the dropped messages stay
    /// unfinished in it) and lets go without a clean handover, so the next
    /// leader waits for them in stream order.
    async fn client_gone(mut self) -> Served {
        let consumer = &self.shared.config.durable;
        tracing::error!(
            consumer = %consumer, running = self.tasks.len(), held = self.held,
            "the NATS client was closed under the consumer: nothing can be pulled or acked on it; \
             stopping (held messages come back after ack_wait)",
        );
        metrics::counter!(names::CLIENT_CLOSED, "consumer" => consumer.clone()).increment(1);
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        self.record_last_checkpoint().await;
        Served::ClientClosed
    }

    /// Takes in what a pull yielded, and whatever else it has already buffered.
    fn received(&mut self, next: Option<Result<jetstream::Message, async_nats::Error>>) {
        let mut next = next;
        loop {
            match next {
                Some(Ok(message)) if self.stopping => self.hand_back(message),
                Some(Ok(message)) => self.admit(message),
                Some(Err(e)) => {
                    self.pull = None;
                    if self.note_client_closed() {
                        return;
                    }
                    tracing::warn!(consumer = %self.shared.config.durable, error = %e, "pull failed; pulling again");
                    self.pull_at = Instant::now() + REPULL_DELAY;
                    return;
                }
                None => {
                    // The pull is complete or expired: the next one goes out
                    // at once (and finds out if the client is closed).
                    self.pull = None;
                    return;
                }
            }
            match next_message(&mut self.pull).now_or_never() {
                Some(more) => next = more,
                None => return,
            }
        }
    }

    /// Holds one received message: decoded, it joins the ready jobs (or waits
    /// behind a previous leader's unfinished event); poison goes to its dead letter.
    fn admit(&mut self, message: jetstream::Message) {
        let info = match DeliveryInfo::from_message(&message) {
            Ok(info) => info,
            Err(e) => {
                tracing::error!(error = %e, subject = %message.subject, "not a JetStream message; ignored");
                return;
            }
        };
        self.held += 1;
        if let Some(checkpoint) = &mut self.checkpoint {
            let consumer = &self.shared.config.durable;
            checkpoint.received(consumer, info.stream_sequence, info.consumer_sequence);
        }
        if let Some(range) = self.gaps.as_mut().and_then(|gaps| gaps.note(&info)) {
            tracing::info!(
                consumer = %self.shared.config.durable, after = range.0, before = range.1,
                "deliveries never arrived: holding what comes until the messages between are known",
            );
            self.explain_gap();
        }
        if let Some(target) =
            crate::dead_letter::replay_for_another(message.headers.as_ref(), &info.consumer)
        {
            let target = target.to_owned();
            self.ignore_replay(message, info, target);
            return;
        }
        match crate::delivery::decode_envelope(&message.payload) {
            Ok(envelope) => {
                let delivery = Delivery::from_decoded(&message.message, envelope, info);
                let delivery = match self.tenure.as_ref() {
                    Some(tenure) => delivery.with_fence(tenure.epoch(), tenure.fence_key()),
                    None => delivery,
                };
                let job = match &mut self.gaps {
                    Some(gaps) => gaps.hold((message, delivery)),
                    None => Some((message, delivery)),
                };
                if let Some(job) = job {
                    self.ready.extend(self.backlog.admit(job));
                }
            }
            Err(poison) => {
                let sequence = info.stream_sequence;
                let task = process::poison(Arc::clone(self.shared), message, info, poison);
                let handle = self.tasks.spawn(async move { vec![task.await] });
                self.tracked.insert(handle.id(), Holding::one(sequence));
            }
        }
    }

    /// Acks, without handling it, a replayed dead letter meant for another
    /// consumer of the stream (see [`crate::dead_letter`]), before it is
    /// decoded, dispatched or batched. Held (as a task with no subject) until
    /// the ack is sent; an ack that fails is redelivered and ignored again.
    fn ignore_replay(&mut self, message: jetstream::Message, info: DeliveryInfo, target: String) {
        metrics::counter!(names::REPLAYS_IGNORED, "consumer" => info.consumer.clone()).increment(1);
        tracing::debug!(
            consumer = %info.consumer, replay_for = %target, stream_sequence = info.stream_sequence,
            "a replayed dead letter for another consumer: acked without being handled",
        );
        let timeout = self.shared.config.ack_timeout;
        let sequence = info.stream_sequence;
        let handle = self.tasks.spawn(async move {
            if let Err(e) = ack::send(&message, AckKind::Ack, timeout).await {
                tracing::debug!(
                    consumer = %info.consumer, stream_sequence = info.stream_sequence, error = %e,
                    "ack of a replay for another consumer failed; it will be redelivered",
                );
            }
            vec![true]
        });
        self.tracked.insert(handle.id(), Holding::one(sequence));
    }

    /// Naks, for immediate redelivery to whoever pulls next, a message that
    /// arrived after shutdown began: it is neither started nor left to wait
    /// out `ack_wait`. Held (as a task with no subject) until the nak is sent.
    fn hand_back(&mut self, message: jetstream::Message) {
        self.held += 1;
        let meta = message
            .info()
            .map(|i| (i.stream_sequence, i.consumer_sequence));
        let holding = match meta {
            Ok((stream, delivery)) => {
                if let Some(checkpoint) = &mut self.checkpoint {
                    checkpoint.received(&self.shared.config.durable, stream, delivery);
                }
                Holding::one(stream)
            }
            Err(_) => Holding::default(),
        };
        let timeout = self.shared.config.ack_timeout;
        let durable = self.shared.config.durable.clone();
        let handle = self.tasks.spawn(async move {
            if let Err(e) = ack::send(&message, AckKind::Nak(None), timeout).await {
                tracing::debug!(consumer = %durable, error = %e, "nak at shutdown failed; redelivered after ack_wait");
            }
            Vec::new()
        });
        self.tracked.insert(handle.id(), holding);
    }

    /// A task ended: its subjects free up (or pass to their next job) and its
    /// messages are no longer held. A task that ended without answering
    /// (a panic of the runtime itself: a handler's panic is caught and fails
    /// its delivery, see [`panics`]) acked none of the messages
    /// it did not finish, and they come back after `ack_wait`; it is logged
    /// with its subjects and events, and a leader holds the later events of
    /// those subjects until they do ([`Backlog::block`]).
    fn task_ended(&mut self, joined: Result<(Id, Vec<bool>), JoinError>) {
        let (id, finished, lost) = match joined {
            Ok((id, finished)) => (id, finished, None),
            Err(e) => {
                let id = e.id();
                let why = match e.try_into_panic() {
                    Ok(payload) => format!("panicked: {}", panics::message(&*payload)),
                    Err(e) => e.to_string(),
                };
                (id, Vec::new(), Some(why))
            }
        };
        let Some(Holding { jobs, sequences }) = self.tracked.remove(&id) else {
            return;
        };
        if let Some(why) = &lost {
            self.report_lost(&jobs, why);
        }
        if finished.iter().any(|done| *done) {
            self.shared.settled.notify_one();
        }
        if let Some(checkpoint) = &mut self.checkpoint {
            for (index, sequence) in sequences.iter().enumerate() {
                if finished.get(index).copied().unwrap_or(false) {
                    checkpoint.finished(*sequence);
                }
            }
        }
        // A poison task holds one message and no subject.
        self.held = self.held.saturating_sub(jobs.len().max(1));
        for (index, envelope) in jobs.into_iter().enumerate() {
            let (key, event) = (envelope.subject(), envelope.id());
            let done = finished.get(index).copied().unwrap_or(false);
            if !done && self.stopping && self.tenure.is_some() {
                // A leader shutting down left this subject's event unfinished
                // (an in-place retry cut short): its later events must not
                // overtake it here.
                let dropped = self.dispatcher.abandon(key).len();
                self.held = self.held.saturating_sub(dropped);
                self.abandoned.insert(key.to_owned());
                continue;
            }
            if lost.is_some() && self.tenure.is_some() {
                let sequence = sequences.get(index).copied().unwrap_or_default();
                self.hold_behind(key, event, sequence);
                continue;
            }
            if let Some(job) = self.dispatcher.finish(key) {
                self.cleared.push_back(job);
            }
            if done {
                self.ready.extend(self.backlog.finished(key, event));
            }
        }
    }

    /// Logs a task that ended without answering, naming what it held.
    fn report_lost(&self, jobs: &[Arc<Envelope<Value>>], why: &str) {
        let consumer = &self.shared.config.durable;
        let subjects: Vec<&str> = jobs.iter().map(|envelope| envelope.subject()).collect();
        let events: Vec<String> = jobs
            .iter()
            .map(|envelope| envelope.id().to_string())
            .collect();
        if self.tenure.is_some() {
            tracing::error!(
                consumer = %consumer, ?subjects, ?events, error = %why,
                "a delivery task ended without finishing (a fault of the runtime, not of a handler): \
                 its messages are not acked and come back after ack_wait; later events of its subjects wait for them",
            );
        } else {
            tracing::error!(
                consumer = %consumer, ?subjects, ?events, error = %why,
                "a delivery task ended without finishing (a fault of the runtime, not of a handler): \
                 its messages are not acked and come back after ack_wait; later events of its subjects may run first",
            );
        }
    }

    /// A leader's task lost `event` of `subject` unacked: the subject's later
    /// jobs, queued behind it or not yet dispatched, wait in the backlog
    /// until JetStream redelivers it and it finishes (or the backlog gives up
    /// on it, after twice the longest redelivery wait plus 10 s).
    fn hold_behind(&mut self, subject: &str, event: EventId, sequence: u64) {
        let deadline = self.redelivery_deadline();
        self.backlog.block(subject, event, sequence, deadline);
        let queued = self.dispatcher.abandon(subject);
        let (undispatched, others): (VecDeque<Job>, VecDeque<Job>) =
            std::mem::take(&mut self.ready)
                .into_iter()
                .partition(|job| job.1.subject() == subject);
        self.ready = others;
        for job in queued.into_iter().chain(undispatched) {
            self.ready.extend(self.backlog.admit(job));
        }
    }

    /// How long an event lost on the way is waited for: twice the longest
    /// redelivery wait, plus 10 s.
    fn redelivery_deadline(&self) -> Instant {
        let config = &self.shared.config;
        let longest = config
            .backoff
            .iter()
            .copied()
            .max()
            .unwrap_or_default()
            .max(config.ack_wait);
        Instant::now() + longest * 2 + Duration::from_secs(10)
    }

    /// Starts explaining the next gap in the deliveries, if none is being
    /// explained ([`gaps`]).
    fn explain_gap(&mut self) {
        let Some(gaps) = &mut self.gaps else { return };
        let Some(range) = gaps.next_range() else {
            return;
        };
        let shared = Arc::clone(self.shared);
        let filters = ghosts::filters_of(&self.consumer.cached_info().config);
        gaps.explain(tokio::spawn(async move {
            ghosts::explain_gap(&shared, &filters, range).await
        }));
    }

    /// A gap is explained: each event lost on the way is made the next its
    /// subject waits for; once no gap is left, the held jobs go on.
    fn gap_explained(&mut self, explained: Result<Vec<ghosts::Lost>, crate::Error>) {
        let consumer = &self.shared.config.durable;
        match explained {
            Ok(lost) => {
                let deadline = self.redelivery_deadline();
                if !lost.is_empty() {
                    let events: Vec<String> = lost.iter().map(|l| l.id.to_string()).collect();
                    tracing::info!(
                        consumer = %consumer, ?events,
                        "events lost on the way: later events of their subjects wait for them to come back",
                    );
                }
                for event in lost {
                    self.backlog
                        .expect(&event.subject, event.id, event.sequence, deadline);
                }
            }
            Err(e) => tracing::warn!(
                consumer = %consumer, error = %e,
                "cannot read which messages never arrived; going on without holding their subjects",
            ),
        }
        self.explain_gap();
        let released = self.gaps.as_mut().map(Gaps::release).unwrap_or_default();
        for job in released {
            self.ready.extend(self.backlog.admit(job));
        }
    }

    /// Sends an in-progress ack for every held message that is not running,
    /// and releases subjects whose previous leader's event never came back.
    fn keep_alive(&mut self) {
        let waiting: Vec<jetstream::Message> = self
            .ready
            .iter()
            .chain(&self.cleared)
            .chain(self.dispatcher.queued_jobs())
            .chain(self.backlog.held())
            .chain(self.gaps.iter().flat_map(Gaps::held))
            .map(|job| job.0.clone())
            .collect();
        if !waiting.is_empty() {
            let timeout = self.shared.config.ack_timeout;
            tokio::spawn(async move {
                for message in waiting {
                    if let Err(e) = ack::send(&message, AckKind::Progress, timeout).await {
                        tracing::debug!(error = %e, "in-progress ack of a waiting message failed");
                    }
                }
            });
        }
        let (released, given_up) = self
            .backlog
            .expire(&self.shared.config.durable, Instant::now());
        if let Some(checkpoint) = &mut self.checkpoint {
            checkpoint.given_up(&given_up);
        }
        self.ready.extend(released);
        self.progress_at = Instant::now() + self.shared.config.progress_every();
    }

    /// Records the leader's checkpoint if it changed, unless a recording is
    /// still under way; takes in a catch-up that ended, or starts one.
    fn record_checkpoint(&mut self) {
        self.checkpoint_at = Instant::now() + checkpoint::SAVE_EVERY;
        self.catch_up();
        let (Some(checkpoint), Some(tenure)) = (&mut self.checkpoint, &self.tenure) else {
            return;
        };
        if let Some(recording) = &mut self.recording {
            match recording.now_or_never() {
                None => return,
                Some(Ok(Some(recorded))) => checkpoint.recorded(recorded),
                Some(_) => {}
            }
            self.recording = None;
        }
        let Some(current) = checkpoint.to_record() else {
            return;
        };
        let pool = self.shared.pool.clone();
        let consumer = self.shared.config.durable.clone();
        let epoch = tenure.epoch();
        self.recording = Some(tokio::spawn(async move {
            record(&pool, &consumer, epoch, current).await
        }));
    }

    /// Takes in the result of a frozen checkpoint's catch-up, or starts one
    /// when it is time (see [`checkpoint`]).
    fn catch_up(&mut self) {
        let Some(checkpoint) = &mut self.checkpoint else {
            return;
        };
        let consumer = &self.shared.config.durable;
        if let Some(running) = &mut self.catching_up {
            let ended = match running.now_or_never() {
                None => return,
                Some(ended) => ended,
            };
            self.catching_up = None;
            self.catch_up_at = Instant::now() + checkpoint::CATCH_UP_EVERY;
            match ended {
                Ok(Ok(caught)) => {
                    if caught.classified_to < caught.delivered {
                        // Bounded: go on from there at the next tick.
                        self.catch_up_at = Instant::now();
                    }
                    checkpoint.caught_up(consumer, caught);
                }
                Ok(Err(e)) => {
                    tracing::warn!(consumer = %consumer, error = %e, "the takeover checkpoint's catch-up failed; trying again");
                    checkpoint.catch_up_failed();
                }
                Err(e) => {
                    tracing::warn!(consumer = %consumer, error = %e, "the takeover checkpoint's catch-up ended; trying again");
                    checkpoint.catch_up_failed();
                }
            }
            return;
        }
        if self.stopping || Instant::now() < self.catch_up_at {
            return;
        }
        let Some(after) = checkpoint.needs_catch_up() else {
            return;
        };
        checkpoint.catching_up();
        let shared = Arc::clone(self.shared);
        let puller = self.consumer.clone();
        self.catching_up = Some(tokio::spawn(async move {
            takeover::catch_up(&shared, &puller, after).await
        }));
    }

    /// Records the checkpoint once more before a leader lets go.
    async fn record_last_checkpoint(&mut self) {
        if let Some(running) = self.catching_up.take() {
            running.abort();
        }
        if let Some(recording) = self.recording.take() {
            let _ = tokio::time::timeout(checkpoint::SAVE_TIMEOUT, recording).await;
        }
        if let (Some(checkpoint), Some(tenure)) = (&self.checkpoint, &self.tenure) {
            let consumer = &self.shared.config.durable;
            record(
                &self.shared.pool,
                consumer,
                tenure.epoch(),
                checkpoint.current(),
            )
            .await;
        }
    }

    fn begin_shutdown(&mut self) {
        tracing::info!(
            consumer = %self.shared.config.durable, running = self.tasks.len(), held = self.held,
            behind_busy_subjects = self.dispatcher.queued(),
            "shutting down: pulling stopped, finishing held messages",
        );
        // The open pull is read to its end (it expires within
        // `PULL_EXPIRES`), not dropped: a pull request cannot be withdrawn,
        // and a message the server sends it while the unsubscribe is still
        // on its way would reach no one and wait out `ack_wait` before
        // anyone else gets it. What arrives now is nak'ed at once instead.
        self.stopping = true;
        let _ = self.stop.send(true);
    }

    fn deposed(mut self) -> Served {
        tracing::warn!(
            consumer = %self.shared.config.durable, running = self.tasks.len(), held = self.held,
            "lost the lead: dropping every held message for the new leader",
        );
        // Dropping the tasks aborts them: their transactions roll back.
        self.tasks.abort_all();
        if let Some(running) = self.catching_up.take() {
            running.abort();
        }
        if self.stopping {
            Served::Shutdown(None)
        } else {
            Served::Deposed
        }
    }
}

impl Holding {
    /// One message and no job.
    fn one(sequence: u64) -> Self {
        Self {
            jobs: Vec::new(),
            sequences: vec![sequence],
        }
    }
}

/// Records `current` as `consumer`'s checkpoint, within
/// [`checkpoint::SAVE_TIMEOUT`]; returns it once recorded.
async fn record(
    pool: &sqlx::PgPool,
    consumer: &str,
    epoch: i64,
    current: Position,
) -> Option<Position> {
    let saving = checkpoint::save(pool, consumer, epoch, current.clone());
    let error = match tokio::time::timeout(checkpoint::SAVE_TIMEOUT, saving).await {
        Ok(Ok(())) => return Some(current),
        Ok(Err(e)) => e.to_string(),
        Err(elapsed) => elapsed.to_string(),
    };
    tracing::warn!(consumer, %error, "cannot record the takeover checkpoint; the last one recorded stands");
    None
}

async fn next_message(
    pull: &mut Option<jetstream::consumer::pull::Batch>,
) -> Option<Result<jetstream::Message, async_nats::Error>> {
    match pull {
        Some(batch) => batch.next().await,
        None => std::future::pending().await,
    }
}

/// Resolves when a leader's gap is explained; never while none is.
async fn explained(gaps: &mut Option<Gaps>) -> Result<Vec<ghosts::Lost>, crate::Error> {
    match gaps {
        Some(gaps) => gaps.explained().await,
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
