//! Taking over an ordered consumer: the events a previous leader left
//! unfinished, and the later events of their subjects held back behind them.
//!
//! A leader that dies holds messages JetStream has delivered and not seen
//! acked: running, queued behind their subject, or just fetched. They come
//! back to the new leader only when their ack wait runs out, and not
//! necessarily in stream order (a message that waited in a queue got no
//! in-progress acks and expires first). Meanwhile the new leader fetches
//! later messages of the same subjects. So before it fetches anything, a new
//! leader [`scan`]s the stream for the events its inbox has neither handled
//! nor dead-lettered, and lets each such subject run only its oldest
//! unfinished event next ([`Backlog`]); every other message of the subject
//! waits, in arrival order. Subjects with nothing unfinished are not held at
//! all.
//!
//! # A bounded scan
//!
//! The messages to look at are those between the consumer's ack floor and
//! its last delivered message. One message left unacked for a long time (a
//! handler that hangs on it, or fails it in place for hours) keeps the floor
//! where it is while everything after it is handled, so that range grows
//! with all traffic since. The scan is therefore bounded three ways:
//!
//! 1. **It starts from the previous leader's checkpoint**, not from the ack
//!    floor: each leader records, about once a second, the stream sequence
//!    below which every message it has to handle is finished except a short
//!    list of sequences (see [`super::checkpoint`]). The scan re-reads that
//!    list (one request each, at most
//!    [`MAX_LISTED`](super::checkpoint::MAX_LISTED)) and the stream from the
//!    checkpoint on, so it reads about one second of traffic and what was
//!    in flight, whatever the stream holds below. A checkpoint below the ack
//!    floor is moved up to it: everything at or below the floor is acked.
//! 2. **It reads in bulk.** The range is read through an ephemeral ordered
//!    consumer with the durable's filter subjects, headers only: the relay
//!    sends the event id as `Nats-Msg-Id`, which is all the inbox check
//!    needs, and a replay's `Inbox-Replay-Consumer` header tells a replay for
//!    another consumer (finished by definition: it is acked unhandled). The
//!    inbox is asked one `= any($2)` query per [`CHUNK`] messages, and only
//!    the unfinished ones are kept; only their bodies are then read (one
//!    request each), for the envelope subject, which no header carries.
//!    A message whose `Nats-Msg-Id` is not an event id (a replay, another
//!    publisher) is read whole, and the id in its body counts; so does an
//!    unfinished one whose body names another id than its header.
//! 3. **A hard bound**, in messages and in time
//!    ([`ConsumerConfig::takeover_scan`](crate::runtime::ConsumerConfig::takeover_scan)),
//!    and on the unfinished events kept. When it is hit, the sequences past
//!    the last chunk classified are not known: any subject may have an
//!    unfinished event there. Then the backlog is *unsettled*: the
//!    unfinished events found still go first, each when it comes back, and
//!    every other message (of every subject) is held, with in-progress
//!    acks, until the backlog's deadline (twice the longest redelivery
//!    delay, plus 10 s), by when every message the previous leader held has
//!    come back; then they all go, in stream order per subject. Slower, and
//!    logged as a warning, but nothing is reordered. The new leader's
//!    checkpoint starts where this scan stopped, and catches up in the
//!    background ([`catch_up`], the same reads within the same bounds, a
//!    round at a time), so the next takeover is short again.
//!
//! What the scan does not do: stop early once it has found as many
//! unfinished events as the consumer has messages pending
//! (`num_ack_pending`). That would be sound only if every event the inbox
//! does not know were pending, and it is not so: a type no route handles is
//! acked with no inbox row ([`Unrouted::Ack`](crate::runtime::Unrouted::Ack)), and
//! would count as unfinished; the stop would then leave a real one unread.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};
use futures::StreamExt;
use outbox_pg::{Envelope, EventId};
use serde_json::Value;
use tokio::time::Instant;
use uuid::Uuid;

use super::checkpoint::{self, CaughtUp, Checkpoint};
use crate::error::{Error, ErrorKind};
use crate::runtime::ghosts;
use crate::runtime::process::Shared;

/// Messages classified per inbox query.
pub(crate) const CHUNK: usize = 1_000;

/// The header the relay sends the event id in.
const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// A job the backlog can hold: it knows its event.
pub(crate) trait Pending {
    /// The envelope subject.
    fn subject(&self) -> &str;
    /// The event id.
    fn event_id(&self) -> EventId;
    /// The message's sequence in the stream.
    fn stream_sequence(&self) -> u64;
}

impl Pending for crate::runtime::Job {
    fn subject(&self) -> &str {
        self.1.subject()
    }

    fn event_id(&self) -> EventId {
        self.1.id()
    }

    fn stream_sequence(&self) -> u64 {
        self.1.info().stream_sequence
    }
}

/// An event a previous leader left unfinished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Unfinished {
    id: EventId,
    sequence: u64,
}

/// Events left unfinished by earlier leaders, per subject in stream order, and
/// the jobs held behind them.
#[derive(Debug)]
pub(crate) struct Backlog<J> {
    blocked: HashMap<String, VecDeque<Unfinished>>,
    held: HashMap<String, Vec<J>>,
    /// The scan did not classify every message: every job that is not a
    /// known unfinished event waits for the deadline.
    unsettled: bool,
    deadline: Option<Instant>,
}

impl<J> Default for Backlog<J> {
    fn default() -> Self {
        Self {
            blocked: HashMap::new(),
            held: HashMap::new(),
            unsettled: false,
            deadline: None,
        }
    }
}

impl<J: Pending> Backlog<J> {
    /// Whether nothing is blocked or held back (every job passes straight through).
    pub(crate) fn is_empty(&self) -> bool {
        self.blocked.is_empty() && !self.unsettled
    }

    /// Unfinished events, over all subjects.
    pub(crate) fn unfinished(&self) -> usize {
        self.blocked.values().map(VecDeque::len).sum()
    }

    /// Returns `job` if it may go to the dispatcher now: its subject has
    /// nothing unfinished (and the backlog is settled), or it is that
    /// subject's oldest unfinished event. Otherwise holds it.
    pub(crate) fn admit(&mut self, job: J) -> Option<J> {
        let subject = job.subject();
        match self.blocked.get(subject) {
            Some(queue) if queue.front().map(|u| u.id) == Some(job.event_id()) => {
                return Some(job);
            }
            None if !self.unsettled => return Some(job),
            _ => {}
        }
        self.held.entry(subject.to_owned()).or_default().push(job);
        None
    }

    /// Event `id` of `subject` was acked or dead-lettered: the jobs that may go
    /// to the dispatcher now, in order.
    pub(crate) fn finished(&mut self, subject: &str, id: EventId) -> Vec<J> {
        let Some(queue) = self.blocked.get_mut(subject) else {
            return Vec::new();
        };
        if queue.front().map(|u| u.id) != Some(id) {
            return Vec::new();
        }
        queue.pop_front();
        if let Some(next) = queue.front().map(|u| u.id) {
            let held = self.held.entry(subject.to_owned()).or_default();
            return match held.iter().position(|job| job.event_id() == next) {
                Some(at) => vec![held.remove(at)],
                None => Vec::new(),
            };
        }
        self.blocked.remove(subject);
        if self.unsettled {
            // What else the subject holds may come after an event the scan
            // did not reach: it waits for the deadline.
            return Vec::new();
        }
        self.held.remove(subject).unwrap_or_default()
    }

    /// Once the deadline has passed, gives up on the events that never came
    /// back (JetStream stopped redelivering them), logging each, and returns
    /// every held job, in stream order, with the stream sequences given up on.
    pub(crate) fn expire(&mut self, consumer: &str, now: Instant) -> (Vec<J>, Vec<u64>) {
        let idle = self.blocked.is_empty() && !self.unsettled;
        if self.deadline.is_none_or(|deadline| now < deadline) || idle {
            return (Vec::new(), Vec::new());
        }
        let mut given_up = Vec::new();
        for (subject, events) in self.blocked.drain() {
            given_up.extend(events.iter().map(|u| u.sequence));
            let events: Vec<String> = events.iter().map(|u| u.id.to_string()).collect();
            tracing::error!(
                consumer, %subject, ?events,
                "events left by an earlier leader never came back; later events of the subject go on without them",
            );
        }
        if self.unsettled {
            tracing::info!(
                consumer,
                held = self.held.values().map(Vec::len).sum::<usize>(),
                "takeover: the previous leader's messages have had time to come back; \
                 every held message goes on, in stream order",
            );
            self.unsettled = false;
        }
        let mut held: Vec<J> = self.held.drain().flat_map(|(_, jobs)| jobs).collect();
        held.sort_by_key(Pending::stream_sequence);
        (held, given_up)
    }

    /// The jobs held back.
    pub(crate) fn held(&self) -> impl Iterator<Item = &J> {
        self.held.values().flatten()
    }

    /// Appends event `id` (at stream `sequence`) to what `subject` waits for,
    /// after what it waits for already: a delivery of it the leader never
    /// received (lost on the way), found in stream order.
    pub(crate) fn expect(&mut self, subject: &str, id: EventId, sequence: u64, deadline: Instant) {
        let queue = self.blocked.entry(subject.to_owned()).or_default();
        if !queue.iter().any(|u| u.id == id) {
            queue.push_back(Unfinished { id, sequence });
        }
        self.deadline = Some(self.deadline.map_or(deadline, |d| d.max(deadline)));
    }

    /// Makes event `id` (at stream `sequence`) the next of `subject` to run: a task of this leader
    /// ended without finishing it (a panic of the runtime itself). Later jobs
    /// of the subject [`admit`](Self::admit)ted from now on wait until it comes
    /// back and finishes, or until [`expire`](Self::expire) gives up on it
    /// after `deadline`.
    pub(crate) fn block(&mut self, subject: &str, id: EventId, sequence: u64, deadline: Instant) {
        let queue = self.blocked.entry(subject.to_owned()).or_default();
        if !queue.iter().any(|u| u.id == id) {
            queue.push_front(Unfinished { id, sequence });
        }
        self.deadline = Some(self.deadline.map_or(deadline, |d| d.max(deadline)));
    }
}

/// What a new leader starts with: the backlog, and the checkpoint it goes on
/// from.
#[derive(Debug)]
pub(crate) struct Takeover<J> {
    pub(crate) backlog: Backlog<J>,
    pub(crate) checkpoint: Checkpoint,
}

/// One message of the range, from its headers.
struct Candidate {
    sequence: u64,
    /// The id its `Nats-Msg-Id` names, if that is an event id.
    id: Option<EventId>,
}

/// An unfinished event: where it is, its id and subject.
struct Found {
    sequence: u64,
    id: EventId,
    subject: String,
}

/// How a scan of the range ended.
enum Ended {
    /// Every message up to the end was classified.
    Complete,
    /// A bound was hit: messages after this sequence are not classified.
    Bounded { classified_to: u64, why: String },
    /// The reader stopped delivering: at a message no client can read
    /// (settled now as a dead letter, [`ghosts`]), or for good (its
    /// connection dropped and the reader it would rebuild under another name
    /// refused). [`read_stream`] reads on after `at` with a new reader.
    /// Messages after `at` are not classified yet.
    Resume { at: u64 },
}

/// The scan's limits (see the [module docs](self)).
struct Bounds {
    deadline: Instant,
    max_messages: usize,
    max_unfinished: usize,
}

impl Bounds {
    /// The limits of a read starting now
    /// ([`ConsumerConfig::takeover_scan`](crate::runtime::ConsumerConfig::takeover_scan)).
    fn from_now(config: &crate::runtime::ConsumerConfig) -> Self {
        let (max_messages, max_time) = config.takeover_scan_bounds();
        Self {
            deadline: Instant::now() + max_time,
            max_messages,
            max_unfinished: max_unfinished(config.max_ack_pending),
        }
    }
}

/// Finds the events that earlier leaders of `consumer` left unfinished,
/// within the bounds of [`ConsumerConfig::takeover_scan`](crate::runtime::ConsumerConfig::takeover_scan).
///
/// # Errors
/// [`ErrorKind::Nats`](crate::ErrorKind::Nats) if the consumer or a stream
/// message cannot be read; [`ErrorKind::Database`](crate::ErrorKind::Database)
/// if the inbox or the checkpoint cannot.
pub(crate) async fn scan<J: Pending>(
    shared: &Shared,
    consumer: &PullConsumer,
) -> Result<Takeover<J>, Error> {
    let started = Instant::now();
    let durable = &shared.config.durable;
    let bounds = Bounds::from_now(&shared.config);
    let info = consumer_info(consumer, durable).await?;
    let (floor, delivered) = (
        info.ack_floor.stream_sequence,
        info.delivered.stream_sequence,
    );
    let next_delivery = info.delivered.consumer_sequence.saturating_add(1);
    if info.num_ack_pending == 0 {
        // Everything delivered is acked: nothing to wait for.
        return Ok(Takeover {
            backlog: Backlog::default(),
            checkpoint: Checkpoint::new(delivered, Some(next_delivery), []),
        });
    }
    let filters = ghosts::filters_of(&info.config);
    let stream = open_stream(shared).await?;

    // 1. Where the previous leader's checkpoint says to start.
    let mut found = Vec::new();
    let (start, listed) =
        from_checkpoint(shared, &stream, &filters, (floor, delivered), &mut found).await?;

    // 2. The range from the checkpoint on, in bulk, within the bounds.
    let (ended, scanned) = if start < delivered {
        read_stream(
            shared,
            &stream,
            &filters,
            (start, delivered),
            &bounds,
            &mut found,
        )
        .await?
    } else {
        (Ended::Complete, 0)
    };

    let (classified_to, next_delivery) = match &ended {
        Ended::Complete => (delivered, Some(next_delivery)),
        Ended::Bounded { classified_to, .. } => (*classified_to, None),
        Ended::Resume { at } => (*at, None),
    };
    found.sort_by_key(|f| f.sequence);
    let open: Vec<u64> = found.iter().map(|f| f.sequence).collect();
    let bounded = matches!(ended, Ended::Bounded { .. });
    let backlog = backlog_of(found, bounded, longest_wait(&info.config));
    let scanned = Scanned {
        floor,
        delivered,
        start,
        listed,
        scanned,
        took: started.elapsed(),
    };
    scanned.log(durable, &ended, &backlog);
    Ok(Takeover {
        backlog,
        checkpoint: Checkpoint::new(classified_to, next_delivery, open),
    })
}

/// Reads the durable's info.
///
/// # Errors
/// [`ErrorKind::Nats`] if JetStream does not answer.
async fn consumer_info(
    consumer: &PullConsumer,
    durable: &str,
) -> Result<async_nats::jetstream::consumer::Info, Error> {
    consumer
        .get_info()
        .await
        .map_err(|e| Error::caused(ErrorKind::Nats, format!("reading consumer `{durable}`"), e))
}

/// Looks up the consumer's stream, to read it by sequence.
///
/// # Errors
/// [`ErrorKind::Nats`] if JetStream does not answer.
async fn open_stream(shared: &Shared) -> Result<Stream, Error> {
    let name = &shared.config.stream;
    shared
        .js
        .get_stream(name)
        .await
        .map_err(|e| Error::caused(ErrorKind::Nats, format!("looking up stream `{name}`"), e))
}

/// Step 1 of a [`scan`]: where the previous leader's checkpoint says to
/// start (the ack floor if there is none, or if it is past `delivered`), and
/// the unfinished among the sequences it lists, put in `found`. Returns the
/// start and how many sequences were listed.
///
/// # Errors
/// As [`scan`].
async fn from_checkpoint(
    shared: &Shared,
    stream: &Stream,
    filters: &[String],
    (floor, delivered): (u64, u64),
    found: &mut Vec<Found>,
) -> Result<(u64, usize), Error> {
    let durable = &shared.config.durable;
    let saved = checkpoint::load(&shared.pool, durable).await?;
    if let Some(saved) = saved.as_ref().filter(|saved| saved.sequence > delivered) {
        tracing::warn!(
            consumer = %durable, checkpoint = saved.sequence, delivered,
            "the takeover checkpoint is past the consumer's last delivered message \
             (the stream or the durable was created again?): scanning from the ack floor",
        );
    }
    let (start, listed) = start_from(saved, floor, delivered);
    // Listed sequences are read whole (their headers alone would need a
    // request each as well).
    let mut candidates: Vec<Candidate> = listed
        .iter()
        .map(|&sequence| Candidate { sequence, id: None })
        .collect();
    classify(shared, stream, filters, &mut candidates, found).await?;
    Ok((start, listed.len()))
}

/// The longest a message can take to come back: the durable's longest
/// redelivery delay, or its ack wait.
fn longest_wait(config: &async_nats::jetstream::consumer::Config) -> Duration {
    config
        .backoff
        .iter()
        .copied()
        .max()
        .unwrap_or_default()
        .max(config.ack_wait)
}

/// What a takeover's scan went through, for its log line.
struct Scanned {
    floor: u64,
    delivered: u64,
    start: u64,
    listed: usize,
    scanned: usize,
    took: Duration,
}

impl Scanned {
    /// The takeover's one line: what earlier leaders left, and whether the
    /// scan hit a bound.
    fn log<J: Pending>(&self, durable: &str, ended: &Ended, backlog: &Backlog<J>) {
        match ended {
            Ended::Complete if backlog.is_empty() => {
                tracing::info!(
                    consumer = %durable, ack_floor = self.floor, delivered = self.delivered,
                    start = self.start, listed = self.listed, scanned = self.scanned, took = ?self.took,
                    "taking over: earlier leaders left nothing unfinished",
                );
            }
            Ended::Complete => {
                tracing::info!(
                    consumer = %durable, events = backlog.unfinished(), subjects = backlog.blocked.len(),
                    ack_floor = self.floor, delivered = self.delivered, start = self.start,
                    listed = self.listed, scanned = self.scanned, took = ?self.took,
                    "taking over: earlier leaders left events unfinished; later events of their subjects wait for them",
                );
            }
            // Never: `read_stream` reads on after a ghost.
            Ended::Resume { .. } => {}
            Ended::Bounded { classified_to, why } => {
                tracing::warn!(
                    consumer = %durable, events = backlog.unfinished(), ack_floor = self.floor,
                    delivered = self.delivered, start = self.start, classified_to, listed = self.listed, scanned = self.scanned,
                    took = ?self.took, bound = %why,
                    wait = ?backlog.deadline.map(|d| d.saturating_duration_since(Instant::now())),
                    "taking over: the scan of what earlier leaders left hit its bound; the unfinished \
                     events found go first, and every other message waits until the earlier leaders' \
                     messages have had time to come back",
                );
            }
        }
    }
}

/// Where the scan starts, and the sequences of the previous leader's
/// checkpoint listed at or below that start (read one by one): from its
/// checkpoint when it is one of this consumer's (at or below its last
/// delivered message), else from the ack floor.
fn start_from(saved: Option<checkpoint::Saved>, floor: u64, delivered: u64) -> (u64, Vec<u64>) {
    match saved {
        Some(saved) if saved.sequence <= delivered => {
            let start = saved.sequence.max(floor);
            // At or below the floor: acked. Above the start: read with the range.
            let mut listed: Vec<u64> = saved
                .pending
                .into_iter()
                .filter(|s| *s > floor && *s <= start)
                .collect();
            listed.sort_unstable();
            listed.dedup();
            (start, listed)
        }
        _ => (floor, Vec::new()),
    }
}

/// The backlog of the unfinished events `found` (in sequence order): each
/// subject's, in order. Once there is one, later messages wait for it until
/// twice the longest redelivery wait (and 10 s) has passed; `unsettled`
/// (the scan hit a bound) makes every message that is not a known unfinished
/// event wait so.
fn backlog_of<J: Pending>(
    found: Vec<Found>,
    unsettled: bool,
    longest_wait: Duration,
) -> Backlog<J> {
    let mut backlog = Backlog::default();
    for f in found {
        backlog
            .blocked
            .entry(f.subject)
            .or_default()
            .push_back(Unfinished {
                id: f.id,
                sequence: f.sequence,
            });
    }
    backlog.unsettled = unsettled;
    if !backlog.is_empty() {
        backlog.deadline = Some(Instant::now() + longest_wait * 2 + Duration::from_secs(10));
    }
    backlog
}

/// For a leader whose checkpoint is frozen at `after` (its takeover scan hit
/// its bound, or a delivery did not reach it): classifies the stream from
/// there to the consumer's last delivered message, as a takeover scan would,
/// within the same bounds, while the leader goes on serving. See
/// [`super::checkpoint`].
///
/// # Errors
/// As [`scan`].
pub(crate) async fn catch_up(
    shared: &Shared,
    consumer: &PullConsumer,
    after: u64,
) -> Result<CaughtUp, Error> {
    let bounds = Bounds::from_now(&shared.config);
    let info = consumer_info(consumer, &shared.config.durable).await?;
    let delivered = info.delivered.stream_sequence;
    let mut caught = CaughtUp {
        next_delivery: info.delivered.consumer_sequence.saturating_add(1),
        delivered,
        classified_to: delivered,
        unfinished: Vec::new(),
    };
    if after >= delivered {
        return Ok(caught);
    }
    let filters = ghosts::filters_of(&info.config);
    let stream = open_stream(shared).await?;
    let mut found = Vec::new();
    let range = (after, delivered);
    let (ended, _) = read_stream(shared, &stream, &filters, range, &bounds, &mut found).await?;
    match ended {
        Ended::Bounded { classified_to, .. } => caught.classified_to = classified_to,
        Ended::Resume { at } => caught.classified_to = at,
        Ended::Complete => {}
    }
    caught.unfinished = found.into_iter().map(|f| f.sequence).collect();
    Ok(caught)
}

/// The most unfinished events a scan keeps before it stops: a few times the
/// messages JetStream lets be pending at once.
fn max_unfinished(max_ack_pending: i64) -> usize {
    let pending = usize::try_from(max_ack_pending)
        .ok()
        .filter(|n| *n > 0)
        .unwrap_or(1_000);
    pending.saturating_mul(4).max(4 * CHUNK)
}

/// [`scan_range`] over `(after, to]`, and again wherever its reader stops
/// ([`Ended::Resume`]). The client drops its connection on a message no
/// client can read, so a reader that met one would never get past it: it is
/// settled as a dead letter ([`ghosts::settle_next`]) and a new reader
/// starts after it. A reader that stalls over readable messages (its
/// connection dropped, and the reader it would rebuild under a new name
/// refused by the NATS user's permissions) is replaced by one of the same
/// name, after what was read. At most [`MOST_READERS`] in one read; past that
/// it ends as a bound.
async fn read_stream(
    shared: &Shared,
    stream: &Stream,
    filters: &[String],
    (after, to): (u64, u64),
    bounds: &Bounds,
    found: &mut Vec<Found>,
) -> Result<(Ended, usize), Error> {
    let (mut start, mut scanned) = (after, 0);
    let mut why = format!("{MOST_READERS} readers stopped");
    for _ in 0..MOST_READERS {
        let (ended, read) = scan_range(shared, stream, filters, (start, to), bounds, found).await?;
        scanned += read;
        let Ended::Resume { at } = ended else {
            return Ok((ended, scanned));
        };
        if at >= to {
            // The reader stopped at the range's last message.
            return Ok((Ended::Complete, scanned));
        }
        start = at;
        if Instant::now() >= bounds.deadline {
            why = format!("time, after a reader stopped at {at}");
            break;
        }
    }
    let ended = Ended::Bounded {
        classified_to: start,
        why,
    };
    Ok((ended, scanned))
}

/// The most readers one read of the stream starts (one more after each
/// message no client can read, or stalled reader).
const MOST_READERS: usize = 64;

/// How long a stream reader may deliver nothing while more is due before the
/// next stored message is looked at ([`ghosts::settle_next`]).
const READ_STALL: Duration = Duration::from_secs(1);

/// After this many stalls in a row over a readable message, a new reader
/// takes over from where this one stopped.
const RESTART_AFTER_STALLS: u32 = 3;

/// Reads the stream over `(after, to]`, headers only, classifying a chunk at
/// a time into `found`, until `to` or a bound. Returns how it ended and how
/// many messages it read.
async fn scan_range(
    shared: &Shared,
    stream: &Stream,
    filters: &[String],
    (after, to): (u64, u64),
    bounds: &Bounds,
    found: &mut Vec<Found>,
) -> Result<(Ended, usize), Error> {
    // Named after the durable (`billing-takeover`), not by the server: a NATS
    // user can then be allowed to create, pull and delete this reader
    // (`$JS.API.CONSUMER.*.<stream>.billing-takeover`) without being allowed
    // any other consumer's, another durable's above all (docs/security.md,
    // "NATS").
    let name = format!("{}-takeover", shared.config.durable);
    // One left by a leader that died while it read would be taken up where
    // it stopped, not at `after`: it goes first (usually there is none).
    if let Err(e) = stream.delete_consumer(&name).await {
        tracing::trace!(consumer = %shared.config.durable, error = %e, "no takeover reader left to delete");
    }
    let reader = stream
        .create_consumer(pull::OrderedConfig {
            name: Some(name),
            filter_subjects: filters.to_vec(),
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: after.saturating_add(1),
            },
            headers_only: true,
            ..Default::default()
        })
        .await
        .map_err(|e| Error::caused(ErrorKind::Nats, "creating the takeover's stream reader", e))?;
    let name = reader.cached_info().name.clone();
    let read = if reader.cached_info().num_pending == 0 {
        Ok((Ended::Complete, 0))
    } else {
        read_range(shared, stream, filters, reader, (after, to), bounds, found).await
    };
    // Left alone, the reader would go after 30 s idle; best effort.
    if let Err(e) = stream.delete_consumer(&name).await {
        tracing::debug!(consumer = %shared.config.durable, error = %e, "could not delete the takeover's stream reader");
    }
    read
}

/// [`scan_range`] once its reader is created.
async fn read_range(
    shared: &Shared,
    stream: &Stream,
    filters: &[String],
    reader: async_nats::jetstream::consumer::Consumer<pull::OrderedConfig>,
    (after, to): (u64, u64),
    bounds: &Bounds,
    found: &mut Vec<Found>,
) -> Result<(Ended, usize), Error> {
    let mut messages = reader
        .messages()
        .await
        .map_err(|e| Error::caused(ErrorKind::Nats, "reading the stream for the takeover", e))?;
    let mut read = RangeRead {
        shared,
        stream,
        filters,
        bounds,
        found,
        chunk: Vec::with_capacity(CHUNK),
        read_to: after,
        scanned: 0,
        stalls: 0,
    };
    let bound = loop {
        if read.scanned >= bounds.max_messages {
            break Some(format!("{} messages", bounds.max_messages));
        }
        let message = match read.next(&mut messages).await? {
            Ok(message) => message,
            Err(Quiet::Bound(why)) => break Some(why),
            Err(Quiet::Nothing) => match read.stalled().await? {
                Some(at) => {
                    read.classify().await?;
                    return Ok((Ended::Resume { at }, read.scanned));
                }
                None => continue,
            },
        };
        match read.take(&message, to).await? {
            Took::More => {}
            Took::Done => break None,
            Took::Bound(why) => break Some(why),
        }
    };
    // What was read is classified, bound or not (at most one chunk more).
    read.classify().await?;
    let ended = match bound {
        Some(why) => Ended::Bounded {
            classified_to: read.read_to,
            why,
        },
        None => Ended::Complete,
    };
    Ok((ended, read.scanned))
}

/// One reader's read of a range ([`read_range`]): what it has read so far.
struct RangeRead<'a> {
    shared: &'a Shared,
    stream: &'a Stream,
    filters: &'a [String],
    bounds: &'a Bounds,
    found: &'a mut Vec<Found>,
    /// Read, not classified yet.
    chunk: Vec<Candidate>,
    /// The last stream sequence read.
    read_to: u64,
    /// How many messages were read.
    scanned: usize,
    /// Looks in a row that brought nothing while more was due.
    stalls: u32,
}

/// Why a reader brought no message.
enum Quiet {
    /// Nothing within [`READ_STALL`] (or the reader failed).
    Nothing,
    /// The time bound ran out.
    Bound(String),
}

/// Where a read stands after a message.
enum Took {
    More,
    /// At the range's end, or past it.
    Done,
    /// Too many unfinished events.
    Bound(String),
}

impl RangeRead<'_> {
    /// Waits for the reader's next message, for up to [`READ_STALL`] and
    /// within the time bound; or says why none came.
    ///
    /// # Errors
    /// [`ErrorKind::Nats`] if the reader ended.
    async fn next(
        &mut self,
        messages: &mut pull::Ordered,
    ) -> Result<Result<async_nats::jetstream::Message, Quiet>, Error> {
        let stall = (Instant::now() + READ_STALL).min(self.bounds.deadline);
        match tokio::time::timeout_at(stall, messages.next()).await {
            Ok(Some(Ok(next))) => Ok(Ok(next)),
            Ok(Some(Err(e))) => {
                tracing::debug!(consumer = %self.shared.config.durable, error = %e, after = self.read_to, "the takeover's stream reader failed");
                Ok(Err(Quiet::Nothing))
            }
            Ok(None) => Err(Error::new(
                crate::ErrorKind::Nats,
                "the takeover's stream reader ended early",
            )),
            Err(_) if Instant::now() >= self.bounds.deadline => {
                let why = format!("time, after {} messages", self.scanned);
                Ok(Err(Quiet::Bound(why)))
            }
            Err(_) => Ok(Err(Quiet::Nothing)),
        }
    }

    /// Nothing came while more is due: if the next stored message is one no
    /// client can read, it is settled and the read goes on after it; if
    /// nothing came [`RESTART_AFTER_STALLS`] times over, a new reader goes on
    /// after what was read (this one may have lost its connection for good).
    /// Returns where to resume, if a new reader is to.
    async fn stalled(&mut self) -> Result<Option<u64>, Error> {
        self.stalls += 1;
        Ok(
            match ghosts::settle_next(self.shared, self.filters, self.read_to).await? {
                Some(at) => Some(at),
                None if self.stalls >= RESTART_AFTER_STALLS => Some(self.read_to),
                None => None,
            },
        )
    }

    /// Takes `message` into the chunk (unless it is past `to`, or a replay
    /// for another consumer), classifying the chunk once it is full.
    async fn take(
        &mut self,
        message: &async_nats::jetstream::Message,
        to: u64,
    ) -> Result<Took, Error> {
        self.stalls = 0;
        let meta = message.info().map_err(|e| {
            Error::caused(
                ErrorKind::Nats,
                "a takeover read carries no JetStream metadata",
                e,
            )
        })?;
        let (sequence, left) = (meta.stream_sequence, meta.pending);
        if sequence > to {
            return Ok(Took::Done);
        }
        self.scanned += 1;
        self.read_to = sequence;
        let headers = message.headers.as_ref();
        // A replay for another consumer is acked unhandled when it comes back.
        if crate::dead_letter::replay_for_another(headers, &self.shared.config.durable).is_none() {
            self.chunk.push(Candidate {
                sequence,
                id: headers.and_then(header_id),
            });
        }
        if self.chunk.len() >= CHUNK {
            self.classify().await?;
            if self.found.len() > self.bounds.max_unfinished {
                return Ok(Took::Bound(format!(
                    "{} unfinished events",
                    self.bounds.max_unfinished
                )));
            }
        }
        Ok(if sequence == to || left == 0 {
            Took::Done
        } else {
            Took::More
        })
    }

    /// Classifies (and empties) the chunk.
    async fn classify(&mut self) -> Result<(), Error> {
        classify(
            self.shared,
            self.stream,
            self.filters,
            &mut self.chunk,
            self.found,
        )
        .await
    }
}

/// The event id a message's `Nats-Msg-Id` names, if it is one.
fn header_id(headers: &HeaderMap) -> Option<EventId> {
    headers.get(MSG_ID_HEADER)?.as_str().parse().ok()
}

/// Classifies (and empties) `chunk`: asks the inbox about the ids the headers
/// name, reads the bodies of the unfinished ones and of those without an id,
/// and appends the unfinished events to `found`.
async fn classify(
    shared: &Shared,
    stream: &Stream,
    filters: &[String],
    chunk: &mut Vec<Candidate>,
    found: &mut Vec<Found>,
) -> Result<(), Error> {
    let durable = &shared.config.durable;
    let ids: Vec<Uuid> = chunk
        .iter()
        .filter_map(|c| c.id.map(|id| *id.as_uuid()))
        .collect();
    let done = done_events(shared, &ids).await?;
    let mut unfinished = Vec::new();
    for candidate in chunk.drain(..) {
        if candidate.id.is_some_and(|id| done.contains(id.as_uuid())) {
            continue;
        }
        let message = match stream.get_raw_message(candidate.sequence).await {
            Ok(message) => message,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => continue,
            Err(e) => {
                return Err(Error::caused(
                    ErrorKind::Nats,
                    format!("reading stream message {}", candidate.sequence),
                    e,
                ));
            }
        };
        if !filters.is_empty() && !filters.iter().any(|f| matches(f, &message.subject)) {
            continue;
        }
        if crate::dead_letter::replay_for_another(Some(&message.headers), durable).is_some() {
            continue;
        }
        // Poison has no subject to hold back; it is dead-lettered wherever it lands.
        let Ok(envelope) = Envelope::<Value>::from_json(&message.payload) else {
            continue;
        };
        unfinished.push((candidate, envelope.id(), envelope.subject().to_owned()));
    }
    // A body naming another id than its header (or a message with none) is
    // asked about by the id in its body.
    let recheck: Vec<Uuid> = unfinished
        .iter()
        .filter(|(c, id, _)| c.id != Some(*id))
        .map(|(_, id, _)| *id.as_uuid())
        .collect();
    let done = done_events(shared, &recheck).await?;
    found.extend(
        unfinished
            .into_iter()
            .filter(|(_, id, _)| !done.contains(id.as_uuid()))
            .map(|(c, id, subject)| Found {
                sequence: c.sequence,
                id,
                subject,
            }),
    );
    Ok(())
}

/// Of `ids`, the events the consumer has handled or dead-lettered.
async fn done_events(shared: &Shared, ids: &[Uuid]) -> Result<HashSet<Uuid>, Error> {
    if ids.is_empty() {
        return Ok(HashSet::new());
    }
    Ok(
        sqlx::query_file_scalar!("queries/done_events.sql", &shared.config.durable, ids)
            .fetch_all(&shared.pool)
            .await
            .map_err(|e| Error::database("reading which pending events are done", e))?
            .into_iter()
            .collect(),
    )
}

/// NATS subject matching: `*` is one token, a final `>` one or more.
fn matches(filter: &str, subject: &str) -> bool {
    let mut subject = subject.split('.');
    for token in filter.split('.') {
        match (token, subject.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (token, Some(s)) if token == s => {}
            _ => return false,
        }
    }
    subject.next().is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    /// A job: subject, event, stream sequence.
    struct J(&'static str, EventId, u8);

    impl Pending for J {
        fn subject(&self) -> &str {
            self.0
        }
        fn event_id(&self) -> EventId {
            self.1
        }
        fn stream_sequence(&self) -> u64 {
            u64::from(self.2)
        }
    }

    fn backlog(blocked: &[(&str, &[EventId])]) -> Backlog<J> {
        let mut b = Backlog::default();
        for (subject, ids) in blocked {
            let queue = ids.iter().map(|&id| Unfinished { id, sequence: 0 });
            b.blocked.insert((*subject).to_owned(), queue.collect());
        }
        b.deadline = Some(Instant::now() + Duration::from_secs(60));
        b
    }

    #[test]
    fn the_scan_starts_at_a_checkpoint_of_this_consumer_else_at_the_ack_floor() {
        let saved = |sequence, pending: &[u64]| {
            Some(checkpoint::Saved {
                sequence,
                pending: pending.to_vec(),
            })
        };
        // From the checkpoint: listed are those above the floor, up to the
        // start, once each, in order (those above the start are in the range).
        assert_eq!(
            start_from(saved(50, &[45, 12, 30, 30, 60, 10]), 20, 100),
            (50, vec![30, 45])
        );
        // A checkpoint below the floor starts at the floor.
        assert_eq!(start_from(saved(15, &[12]), 20, 100), (20, vec![]));
        // One past the last delivered message is not this consumer's.
        assert_eq!(start_from(saved(150, &[120]), 20, 100), (20, vec![]));
        assert_eq!(start_from(None, 20, 100), (20, vec![]));
    }

    #[test]
    fn the_backlog_holds_each_subjects_unfinished_events_in_order_with_a_deadline() {
        let (e1, e2, e3) = (EventId::new(), EventId::new(), EventId::new());
        let found = |subject: &str, id, sequence| Found {
            sequence,
            id,
            subject: subject.to_owned(),
        };
        let b: Backlog<J> = backlog_of(
            vec![found("s", e1, 3), found("t", e2, 4), found("s", e3, 7)],
            false,
            Duration::from_secs(30),
        );
        let ids: Vec<EventId> = b.blocked["s"].iter().map(|u| u.id).collect();
        assert_eq!(ids, [e1, e3]);
        assert_eq!(b.unfinished(), 3);
        let wait = b
            .deadline
            .unwrap()
            .saturating_duration_since(Instant::now());
        assert!(
            wait > Duration::from_secs(60) && wait <= Duration::from_secs(70),
            "{wait:?}"
        );

        // Nothing found and nothing unsettled: no deadline, nothing waits.
        let b: Backlog<J> = backlog_of(Vec::new(), false, Duration::from_secs(30));
        assert!(b.is_empty() && b.deadline.is_none());
        // A bounded scan: everything waits, with a deadline.
        let b: Backlog<J> = backlog_of(Vec::new(), true, Duration::from_secs(30));
        assert!(!b.is_empty() && b.deadline.is_some());
    }

    #[test]
    fn a_subject_runs_its_unfinished_events_in_order_before_anything_later() {
        let (e1, e2, e3, e4) = (
            EventId::new(),
            EventId::new(),
            EventId::new(),
            EventId::new(),
        );
        let mut b = backlog(&[("s", &[e1, e2])]);
        // e2 comes back first, then a new event, then e1.
        assert_eq!(b.admit(J("s", e2, 1)), None);
        assert_eq!(b.admit(J("s", e3, 2)), None);
        assert_eq!(b.admit(J("s", e1, 3)), Some(J("s", e1, 3)));
        // Other subjects pass straight through.
        assert_eq!(b.admit(J("t", e4, 4)), Some(J("t", e4, 4)));
        // e1 done: e2 (held) goes next, alone.
        assert_eq!(b.finished("s", e1), vec![J("s", e2, 1)]);
        assert!(!b.is_empty());
        // e2 done: everything held goes, in arrival order, and the subject is free.
        assert_eq!(b.finished("s", e2), vec![J("s", e3, 2)]);
        assert!(b.is_empty());
        assert_eq!(b.admit(J("s", e3, 5)), Some(J("s", e3, 5)));
    }

    #[test]
    fn the_next_unfinished_event_waits_until_it_arrives() {
        let (e1, e2, e3) = (EventId::new(), EventId::new(), EventId::new());
        let mut b = backlog(&[("s", &[e1, e2])]);
        assert_eq!(b.admit(J("s", e1, 1)), Some(J("s", e1, 1)));
        assert_eq!(b.admit(J("s", e3, 2)), None);
        assert_eq!(b.finished("s", e1), vec![]);
        assert_eq!(b.admit(J("s", e2, 3)), Some(J("s", e2, 3)));
        assert_eq!(b.finished("s", e2), vec![J("s", e3, 2)]);
        // A finish that is not the subject's oldest changes nothing.
        assert_eq!(b.finished("s", e3), vec![]);
    }

    #[test]
    fn after_the_deadline_held_jobs_go_on_without_the_missing_events() {
        let (e1, e2) = (EventId::new(), EventId::new());
        let mut b = backlog(&[("s", &[e1])]);
        assert_eq!(b.admit(J("s", e2, 1)), None);
        assert_eq!(b.expire("c", Instant::now()), (vec![], vec![]));
        let later = Instant::now() + Duration::from_secs(61);
        assert_eq!(b.expire("c", later), (vec![J("s", e2, 1)], vec![0]));
        assert!(b.is_empty());
        assert_eq!(b.held().count(), 0);
    }

    #[test]
    fn an_event_a_task_lost_runs_before_the_later_events_of_its_subject() {
        let (lost, later, other) = (EventId::new(), EventId::new(), EventId::new());
        let mut b: Backlog<J> = Backlog::default();
        b.block("s", lost, 7, Instant::now() + Duration::from_secs(60));
        assert_eq!(b.admit(J("s", later, 1)), None);
        assert_eq!(b.admit(J("t", other, 2)), Some(J("t", other, 2)));
        // The lost event comes back, runs, finishes: the later one goes.
        assert_eq!(b.admit(J("s", lost, 3)), Some(J("s", lost, 3)));
        assert_eq!(b.finished("s", lost), vec![J("s", later, 1)]);
        assert!(b.is_empty());
        // Blocked again behind one that never comes back: released at the deadline.
        b.block("s", lost, 7, Instant::now() + Duration::from_secs(60));
        b.block("s", lost, 7, Instant::now());
        assert_eq!(b.unfinished(), 1);
        assert_eq!(b.admit(J("s", later, 4)), None);
        assert_eq!(b.expire("c", Instant::now()), (vec![], vec![]));
        let after = Instant::now() + Duration::from_secs(61);
        assert_eq!(b.expire("c", after), (vec![J("s", later, 4)], vec![7]));
    }

    #[test]
    fn an_unsettled_backlog_lets_only_known_unfinished_events_go_until_the_deadline() {
        let (e1, e2, e3, e4, e5) = (
            EventId::new(),
            EventId::new(),
            EventId::new(),
            EventId::new(),
            EventId::new(),
        );
        let mut b = backlog(&[("s", &[e1])]);
        b.unsettled = true;
        assert!(!b.is_empty());
        // Another subject waits too: it may have an event the scan did not reach.
        assert_eq!(b.admit(J("t", e2, 9)), None);
        assert_eq!(b.admit(J("s", e3, 8)), None);
        assert_eq!(b.admit(J("s", e1, 2)), Some(J("s", e1, 2)));
        // s's known event done: what s holds still waits.
        assert_eq!(b.finished("s", e1), vec![]);
        // A redelivery from the part not scanned, older than what waits.
        assert_eq!(b.admit(J("t", e4, 5)), None);
        assert_eq!(b.admit(J("u", e5, 7)), None);
        assert_eq!(b.expire("c", Instant::now()), (vec![], vec![]));
        let later = Instant::now() + Duration::from_secs(61);
        let (released, given_up) = b.expire("c", later);
        assert_eq!(
            released,
            vec![J("t", e4, 5), J("u", e5, 7), J("s", e3, 8), J("t", e2, 9)],
            "everything goes, in stream order"
        );
        assert!(given_up.is_empty());
        assert!(b.is_empty());
        assert_eq!(b.admit(J("t", e2, 10)), Some(J("t", e2, 10)));
    }

    #[test]
    fn subject_filters_match_like_nats() {
        assert!(matches("a.b", "a.b"));
        assert!(!matches("a.b", "a.b.c"));
        assert!(!matches("a.b.c", "a.b"));
        assert!(matches("a.*", "a.b"));
        assert!(!matches("a.*", "a.b.c"));
        assert!(matches("a.>", "a.b.c"));
        assert!(!matches("a.>", "a"));
        assert!(matches(">", "a"));
        assert!(matches("*.b", "x.b"));
        assert!(!matches("a.b", "a.c"));
    }
}
