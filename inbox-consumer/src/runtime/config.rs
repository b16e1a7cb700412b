//! [`ConsumerConfig`]: the durable consumer and the runtime around it.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};

use crate::retention::Retention;
use crate::retry::RetryPolicy;

/// The default [`ConsumerConfig::ack_wait`]: 3 s.
///
/// Chosen so that what a dead process held is handled elsewhere within 5 s
/// of its death: JetStream redelivers each message at most 3 s after its
/// last in-progress ack, which leaves 2 s for the server's timer, the pull
/// that receives it and the handler. An in-progress ack every second
/// ([`ConsumerConfig::progress_interval`]) keeps every message a live
/// process holds, however long its handler runs.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(3);

/// Configuration of a [`Consumer`](super::Consumer): the JetStream durable pull
/// consumer it creates (or updates) and how the runtime drives it.
///
/// Setters take and return the config; the default of each is on its setter.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    pub(crate) stream: String,
    pub(crate) durable: String,
    pub(crate) filter_subjects: Vec<String>,
    pub(crate) ack_wait: Duration,
    pub(crate) max_deliver: i64,
    pub(crate) backoff: Vec<Duration>,
    pub(crate) max_ack_pending: i64,
    pub(crate) concurrency: usize,
    pub(crate) max_buffered: usize,
    pub(crate) batch: usize,
    pub(crate) progress_interval: Option<Duration>,
    pub(crate) retry: RetryPolicy,
    pub(crate) ack_timeout: Duration,
    pub(crate) dead_letter_subject: Option<String>,
    pub(crate) retention: Retention,
    pub(crate) prune: bool,
    pub(crate) ordered: bool,
    pub(crate) lease_timeout: Duration,
    pub(crate) unrouted: Unrouted,
    pub(crate) max_batch: usize,
    pub(crate) start: Start,
    pub(crate) takeover_scan: (usize, Duration),
}

/// What the runtime does with a message whose event type no route handles
/// (it arrived through a filter wider than the router).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Unrouted {
    /// Ack it without an effect, count it (`inbox_unrouted_total`, labelled
    /// `consumer` and `event_type`) and log it at debug level. The default:
    /// a consumer that subscribes to a whole stream only wants its own types.
    #[default]
    Ack,
    /// Dead-letter it as `unroutable`: every type on the filter is meant to be
    /// handled, and one that is not is a deployment error to look at.
    DeadLetter,
}

/// Where a durable the runtime creates starts. See the
/// [position docs](super::position).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Start {
    /// After the consumer's recorded position, or after the position of the
    /// consumer it renames (same stream, same filter subjects), or, for a
    /// consumer that never ran against this inbox, the start of the stream.
    #[default]
    Auto,
    /// The whole stream, whatever is recorded: a replay asked for. Events
    /// whose inbox rows are past the retention window are applied again.
    All,
    /// Only messages stored after the durable is created.
    New,
    /// From this stream sequence on.
    Sequence(u64),
}

impl ConsumerConfig {
    /// A durable consumer `durable` on `stream`. The durable name is also the
    /// inbox dedupe namespace: keep it stable.
    pub fn new(stream: impl Into<String>, durable: impl Into<String>) -> Self {
        Self {
            stream: stream.into(),
            durable: durable.into(),
            filter_subjects: Vec::new(),
            ack_wait: DEFAULT_ACK_WAIT,
            max_deliver: 10,
            backoff: Vec::new(),
            max_ack_pending: 1_000,
            concurrency: 16,
            max_buffered: 256,
            batch: 64,
            progress_interval: None,
            retry: RetryPolicy::default(),
            ack_timeout: Duration::from_secs(5),
            dead_letter_subject: None,
            retention: Retention::default(),
            prune: true,
            ordered: false,
            lease_timeout: Duration::from_secs(15),
            unrouted: Unrouted::Ack,
            max_batch: 64,
            start: Start::Auto,
            takeover_scan: (1_000_000, Duration::from_secs(5)),
        }
    }

    /// Only these subjects (event types; wildcards allowed). Default: the
    /// whole stream. [`Router::event_types`](crate::Router::event_types) lists
    /// a router's, and [`for_router`](Self::for_router) sets them: subscribe to
    /// what you handle. Types on the filter that no route handles are acked
    /// and counted (see [`unrouted`](Self::unrouted)).
    #[must_use]
    pub fn filter_subjects(
        mut self,
        subjects: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        self.filter_subjects = subjects.into_iter().map(Into::into).collect();
        self
    }

    /// How long JetStream waits for an ack (or an in-progress ack) before
    /// redelivering. Default: [`DEFAULT_ACK_WAIT`], 3 s.
    ///
    /// It is how long the messages a process held wait after the process
    /// dies (a `kill -9`, a lost machine, a dropped client) before JetStream
    /// hands them to another puller: at most `ack_wait` after its last
    /// in-progress ack. It does not bound a handler: every message the
    /// runtime holds, running or waiting, gets an in-progress ack every
    /// [`progress_interval`](Self::progress_interval) (a third of this), so a
    /// slow handler's message, and those waiting behind it, are not
    /// redelivered while the process lives.
    ///
    /// The durable is created or updated to this value at start, so a
    /// durable created with another (the 30 s of earlier versions) takes
    /// the new one when its consumer starts.
    #[must_use]
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// The delivery budget: on the delivery with this number (or a later
    /// one), a failing event is dead-lettered instead of retried (`-1`:
    /// unlimited, retried for ever). Default: 10.
    ///
    /// The runtime counts it, from the delivery count JetStream reports: the
    /// durable consumer itself is created with an unlimited `max_deliver`, so
    /// the broker never stops redelivering a message the runtime has not
    /// finished (acked after its effect committed, or terminated after its
    /// dead letter committed). A failure that is not the event's fault (the
    /// database unreachable, a lock wait timed out) never ends in a dead
    /// letter, however many deliveries it takes; and a dead letter that cannot
    /// be written is retried like any database failure.
    #[must_use]
    pub fn max_deliver(mut self, max_deliver: i64) -> Self {
        self.max_deliver = max_deliver;
        self
    }

    /// Redelivery delays after ack-wait expiries, instead of `ack_wait` each
    /// time (JetStream `backoff`; needs `max_deliver` above its length).
    /// Only the messages of a process that stopped speaking for them get
    /// there. The default [`progress_interval`](Self::progress_interval) is a
    /// third of the shortest of `ack_wait` and these steps. Default: none.
    #[must_use]
    pub fn backoff(mut self, backoff: Vec<Duration>) -> Self {
        self.backoff = backoff;
        self
    }

    /// Unacked messages JetStream hands this consumer (all replicas) at most.
    /// Default: 1,000.
    #[must_use]
    pub fn max_ack_pending(mut self, max_ack_pending: i64) -> Self {
        self.max_ack_pending = max_ack_pending;
        self
    }

    /// Deliveries handled at once by this process (each holds a pool
    /// connection while it runs). Default: 16.
    #[must_use]
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// Messages held by this process at once, running or waiting (behind a
    /// busy subject, or for a free slot). A pull never asks for more than the
    /// room left under it, so nothing waits unseen in a client buffer; every
    /// held message keeps its ack deadline with in-progress acks. Default: 256.
    #[must_use]
    pub fn max_buffered(mut self, max_buffered: usize) -> Self {
        self.max_buffered = max_buffered.max(1);
        self
    }

    /// Messages asked for per pull request (at most the room left under
    /// [`max_buffered`](Self::max_buffered); with
    /// [`Consumer::run_batched`](super::Consumer::run_batched), at least
    /// [`max_batch`](Self::max_batch) × [`concurrency`](Self::concurrency),
    /// so that under a backlog every slot's next batch has arrived when it
    /// starts). Default: 64.
    #[must_use]
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How often every held message (running or waiting) gets an in-progress
    /// ack (`+WPI`, which restarts its `ack_wait`). Default: a third of
    /// `ack_wait`, or of the shortest [`backoff`](Self::backoff) step if
    /// shorter (1 s with the defaults), which leaves two periods
    /// of slack for an ack delayed by a busy process or network before a
    /// live process's message could be redelivered. Keep it well under
    /// `ack_wait`.
    #[must_use]
    pub fn progress_interval(mut self, every: Duration) -> Self {
        self.progress_interval = Some(every);
        self
    }

    /// Nak delays for retryable failures. Default: 1 s doubling to 5 min.
    #[must_use]
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Bound on each ack, nak, term or DLQ publish. Default: 5 s.
    #[must_use]
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// Also publish dead letters to this subject (it must belong to a stream
    /// that this consumer does not read). Default: table only.
    #[must_use]
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// Inbox and dead-letter retention: windows, batch and interval. Default:
    /// [`Retention::default`] (14 days for the inbox, checked against
    /// redelivery at start-up; 30 days for dead letters; hourly).
    #[must_use]
    pub fn retention(mut self, retention: Retention) -> Self {
        self.retention = retention;
        self
    }

    /// Whether this process prunes the inbox and the dead letters on the
    /// retention interval (disable when a separate job prunes). Default: true.
    #[must_use]
    pub fn prune(mut self, prune: bool) -> Self {
        self.prune = prune;
        self
    }

    /// What to do with a message whose event type no route handles.
    /// Default: [`Unrouted::Ack`] (acked and counted).
    #[must_use]
    pub fn unrouted(mut self, unrouted: Unrouted) -> Self {
        self.unrouted = unrouted;
        self
    }

    /// The most deliveries [`Consumer::run_batched`](super::Consumer::run_batched)
    /// hands its service at once (one transaction for all of them, then the
    /// acks). At least 1. Default: 64. A batch holds messages of distinct
    /// subjects only, so it fills up to this size only with that many busy
    /// subjects; [`max_buffered`](Self::max_buffered) should be at least
    /// `concurrency × max_batch` for full batches.
    #[must_use]
    pub fn max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch.max(1);
        self
    }

    /// [`new`](Self::new), filtered to the event types `router` handles.
    pub fn for_router<Req, Resp>(
        stream: impl Into<String>,
        durable: impl Into<String>,
        router: &crate::Router<Req, Resp>,
    ) -> Self
    where
        Req: Send + 'static,
        Resp: Send + 'static,
    {
        Self::new(stream, durable).filter_subjects(router.event_types())
    }

    /// Per-subject order across every replica of this consumer: no two events
    /// of one subject are ever handled at once, anywhere, and they are applied
    /// in stream order. Default: false.
    ///
    /// One replica at a time leads and fetches; the others stand by and take
    /// over when it dies (at once when its process exits; after
    /// [`lease_timeout`](Self::lease_timeout) when it hangs or loses the
    /// database). Within the leader, up to [`concurrency`](Self::concurrency)
    /// subjects still run at once, and a failing delivery is retried in
    /// place, holding back its subject, instead of being nak'ed past.
    /// A new leader first finds the events its predecessor left unfinished
    /// and holds back later events of their subjects until they are done.
    /// Every handler transaction is fenced: a deposed leader's commits roll
    /// back. The cost: the consumer's throughput is one process's, whatever
    /// the replica count (see the crate's `BENCHMARKS.md`). Every replica of
    /// the durable must use the same setting. Needs PostgreSQL 14 or later,
    /// reached directly or through a session-pooling proxy (the leadership is
    /// a session lock; transaction pooling would lose it).
    /// See [`runtime`](crate::runtime#ordered-consumption).
    #[must_use]
    pub fn ordered(mut self, ordered: bool) -> Self {
        self.ordered = ordered;
        self
    }

    /// How long a leader may stay silent towards the database before a standby
    /// takes over (it is also the leadership session's
    /// `idle_session_timeout`). A leader that cannot confirm its session for
    /// half of it steps down by itself. At least 3 s. Default: 15 s.
    #[must_use]
    pub fn lease_timeout(mut self, timeout: Duration) -> Self {
        self.lease_timeout = timeout.max(Duration::from_secs(3));
        self
    }

    /// Where the durable starts if the runtime has to create it (it does not
    /// exist: new, or deleted by an operator). Default: [`Start::Auto`], after
    /// where the inbox records this consumer (or the consumer it renames) to
    /// stand, so that no event past the inbox window is applied again; see
    /// [`runtime::position`](super::position). An existing durable keeps its
    /// own start.
    pub fn start(mut self, start: Start) -> Self {
        self.start = start;
        self
    }

    /// The bound of an ordered consumer's takeover scan: at most
    /// `max_messages` stream messages read, for at most `max_time`. The scan
    /// reads from where the previous leader's checkpoint stands (about a
    /// second of traffic behind it) and is normally far inside both. When one
    /// is hit, the new leader lets the unfinished events it found go first
    /// and holds every other message until the previous leader's messages
    /// have had time to come back (twice the longest redelivery delay, plus
    /// 10 s), then releases them in stream order: a slower failover, never a
    /// reordering. See [`runtime`](crate::runtime#ordered-consumption).
    /// Default: 1,000,000 messages, 5 s.
    #[must_use]
    pub fn takeover_scan(mut self, max_messages: usize, max_time: Duration) -> Self {
        self.takeover_scan = (max_messages, max_time);
        self
    }

    /// The durable consumer name (the inbox namespace).
    pub fn durable(&self) -> &str {
        &self.durable
    }

    /// The stream name.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The takeover scan's bound: messages and time.
    pub(crate) fn takeover_scan_bounds(&self) -> (usize, Duration) {
        self.takeover_scan
    }

    /// How often each held message gets an in-progress ack: the setting, or
    /// a third of the shortest wait JetStream may apply to a message (the
    /// ack wait, or a `backoff` step, which replaces it on later deliveries).
    pub(crate) fn progress_every(&self) -> Duration {
        let shortest = self
            .backoff
            .iter()
            .copied()
            .filter(|step| !step.is_zero())
            .fold(self.ack_wait, Duration::min);
        self.progress_interval
            .unwrap_or(shortest / 3)
            .max(Duration::from_millis(10))
    }

    /// The JetStream consumer configuration, delivering from `deliver_policy`.
    pub(crate) fn pull_config(&self, deliver_policy: DeliverPolicy) -> pull::Config {
        let mut config = pull::Config {
            durable_name: Some(self.durable.clone()),
            deliver_policy,
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            // Unlimited: the runtime counts deliveries itself (see `max_deliver`).
            max_deliver: -1,
            backoff: self.backoff.clone(),
            max_ack_pending: self.max_ack_pending,
            ..Default::default()
        };
        match self.filter_subjects.as_slice() {
            [] => {}
            [one] => config.filter_subject = one.clone(),
            many => config.filter_subjects = many.to_vec(),
        }
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_acks_come_three_times_per_shortest_wait() {
        let config = ConsumerConfig::new("S", "d");
        assert_eq!(config.ack_wait, DEFAULT_ACK_WAIT);
        assert_eq!(config.progress_every(), Duration::from_secs(1));
        let backoff = config
            .clone()
            .backoff(vec![Duration::from_millis(1_500), Duration::from_secs(60)]);
        assert_eq!(backoff.progress_every(), Duration::from_millis(500));
        let longer = config.clone().backoff(vec![Duration::from_secs(60)]);
        assert_eq!(longer.progress_every(), Duration::from_secs(1));
        let set = config.progress_interval(Duration::from_millis(250));
        assert_eq!(set.progress_every(), Duration::from_millis(250));
    }

    #[test]
    fn the_durable_gets_the_ack_wait() {
        let config = ConsumerConfig::new("S", "d");
        assert_eq!(
            config.pull_config(DeliverPolicy::All).ack_wait,
            Duration::from_secs(3)
        );
        let longer = config.ack_wait(Duration::from_secs(30));
        assert_eq!(
            longer.pull_config(DeliverPolicy::All).ack_wait,
            Duration::from_secs(30)
        );
    }
}
