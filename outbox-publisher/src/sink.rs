//! Where events go: the [`Sink`] trait and its JetStream implementation.
//!
//! [`JetStreamSink`] judges rows by the stream as it is now, not as it was at
//! start: it follows a [`StreamView`]. A subject
//! the view does not capture, and any refusal by the broker, make it read
//! the stream again before it decides; a message refused because the
//! stream changed under it (a subject just added, a limit just raised) is
//! sent once more. Into a stream with `allow_atomic`, it publishes runs of
//! messages as JetStream atomic batches (stored whole, in order, or not at
//! all; see the relay's batch module for how the relay uses them).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, ErrorCode, context::PublishErrorKind};
use async_nats::{HeaderMap, HeaderValue, connection::State};
use bytes::Bytes;
use outbox_pg::EventId;
use tokio::sync::Semaphore;
use tracing::debug;
use uuid::Uuid;

use crate::stream::subject_matches;
use crate::stream_view::{Change, StreamView};

/// One message to publish: the envelope's JSON on the subject `event_type`.
#[derive(Debug, Clone)]
pub struct OutgoingMessage {
    /// The event id; sent as `Nats-Msg-Id` so the stream drops a republish.
    pub id: EventId,
    /// The NATS subject (the event type).
    pub subject: String,
    /// CloudEvents structured-mode JSON.
    pub payload: Bytes,
    /// W3C `traceparent`, sent as a header of that name.
    pub traceparent: Option<String>,
    /// W3C `tracestate`, sent as a header of that name.
    pub tracestate: Option<String>,
}

/// The broker's acknowledgement of a stored message.
///
/// The relay keeps the position (`stream`, `sequence`) on the row
/// (`published_stream`, `published_seq`), where the audit reads the message
/// back. A sink whose broker has no such position leaves `stream` empty or
/// `sequence` 0 ([`PublishAck::without_position`]): its rows are marked
/// published without one and are not audited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishAck {
    /// The stream that stored it; empty when the sink reports no position.
    pub stream: String,
    /// Its sequence in the stream (from 1); 0 when the sink reports no
    /// position. For a duplicate, the sequence of the message already stored.
    pub sequence: u64,
    /// The stream already held a message with this id (a republish): it was
    /// not stored again, and the event counts as published.
    pub duplicate: bool,
}

impl PublishAck {
    /// An ack that says where the message is stored.
    pub fn new(stream: impl Into<String>, sequence: u64, duplicate: bool) -> Self {
        Self {
            stream: stream.into(),
            sequence,
            duplicate,
        }
    }

    /// An ack from a broker without stream positions.
    pub fn without_position(duplicate: bool) -> Self {
        Self {
            stream: String::new(),
            sequence: 0,
            duplicate,
        }
    }

    /// The stream and sequence the message is stored at, if the sink said.
    pub fn position(&self) -> Option<(&str, u64)> {
        (!self.stream.is_empty() && self.sequence > 0)
            .then_some((self.stream.as_str(), self.sequence))
    }
}

/// Why a publish failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// Not connected to the broker; nothing was sent.
    Unavailable,
    /// No ack within the publish timeout.
    Timeout,
    /// No stream answered for the subject, or the relay's stream does not
    /// exist (deleted, not recreated yet).
    NoStream,
    /// The relay's stream exists and, read again, still does not capture the
    /// subject: a configuration problem the operator fixes on the stream
    /// (`nats stream edit … --subjects …`), not on the row. The row waits in
    /// the retry lane, without losing attempts, and is published once the
    /// stream captures it.
    NotCaptured,
    /// The stream refused the message (limits, wrong stream, …).
    Rejected,
    /// Larger than the broker's max payload: it can never be published as is.
    TooLarge,
    /// The row cannot be turned into a message (invalid subject or envelope):
    /// it can never be published as is.
    Invalid,
}

impl FailureKind {
    /// A label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unavailable => "unavailable",
            Self::Timeout => "timeout",
            Self::NoStream => "no_stream",
            Self::NotCaptured => "not_captured",
            Self::Rejected => "rejected",
            Self::TooLarge => "too_large",
            Self::Invalid => "invalid",
        }
    }

    /// Whether the broker, not the row, is at fault (not connected, no ack in
    /// time, no stream answering): the row is tried again later at no cost to
    /// its attempts.
    pub fn is_broker_fault(self) -> bool {
        matches!(self, Self::Unavailable | Self::Timeout | Self::NoStream)
    }

    /// Whether retrying the same row can never succeed.
    pub fn is_permanent(self) -> bool {
        matches!(self, Self::TooLarge | Self::Invalid)
    }

    /// Whether the failure counts toward the row's attempts (and so its
    /// cap): a refusal of the row itself. Broker faults and
    /// [`NotCaptured`](Self::NotCaptured) (the stream's configuration, which
    /// an operator fixes without touching rows) do not.
    pub fn counts_as_attempt(self) -> bool {
        !self.is_broker_fault() && self != Self::NotCaptured
    }
}

/// A failed publish of one message.
#[derive(Debug, Clone)]
pub struct PublishFailure {
    kind: FailureKind,
    message: String,
}

impl PublishFailure {
    /// A failure of `kind`, described by `message`.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }
}

impl fmt::Display for PublishFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)
    }
}

impl std::error::Error for PublishFailure {}

/// A broker the relay publishes to. Implementations must only return `Ok` once
/// the broker has durably accepted the message.
pub trait Sink: Send + Sync + 'static {
    /// Publishes one message and waits (bounded) for the broker's ack.
    fn publish(
        &self,
        message: OutgoingMessage,
    ) -> impl Future<Output = Result<PublishAck, PublishFailure>> + Send;

    /// Whether the broker connection is up; when it is not, the relay does not
    /// claim rows it could not publish.
    fn is_available(&self) -> bool {
        true
    }

    /// Whether the sink's connection is closed for good, so that no publish
    /// can ever succeed on it again (not merely down: a broker that comes
    /// back is waited for). Asked after publishes failed; a relay that gets
    /// `true` stops with [`ErrorKind::ClientClosed`](crate::ErrorKind::ClientClosed).
    /// Default: never.
    fn is_closed(&self) -> bool {
        false
    }

    /// The largest message (payload and headers) the broker accepts; larger
    /// rows are parked without being fetched whole.
    fn max_payload(&self) -> usize {
        DEFAULT_MAX_PAYLOAD
    }

    /// How many of `messages`, from the first, [`publish_batch`](Self::publish_batch)
    /// would take into one atomic batch now. The relay sends a batch only of
    /// 16 messages or more, and publishes them one at a time otherwise.
    /// Default: 0 (no batches).
    fn batch_len(&self, messages: &[OutgoingMessage]) -> usize {
        let _ = messages;
        0
    }

    /// Publishes `messages` (at most [`batch_len`](Self::batch_len) of them)
    /// as one atomic batch and waits (bounded) for the broker's ack of the
    /// whole. `Ok` means every message is stored, in order, and holds one
    /// ack per message in that order. On `Err` what is stored is a prefix
    /// of `messages`, in order (none of them, but for a broker whose store
    /// fails part way through a commit); an `Err` whose kind is a
    /// [broker fault](FailureKind::is_broker_fault) says nothing more, any
    /// other is a refusal. A later message is never stored without every
    /// earlier one. Default: refused, nothing sent.
    fn publish_batch(
        &self,
        messages: Vec<OutgoingMessage>,
    ) -> impl Future<Output = Result<Vec<PublishAck>, PublishFailure>> + Send {
        let _ = messages;
        std::future::ready(Err(PublishFailure::new(
            FailureKind::Rejected,
            "this sink does not publish batches",
        )))
    }

    /// Reads again what the sink knows of the broker's configuration (the
    /// stream's subjects and limits); called by a running relay every
    /// [`RelayConfig::stream_refresh`](crate::RelayConfig::stream_refresh).
    /// Bounded; failures are the sink's to log. Default: nothing.
    fn refresh(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}

/// NATS' default `max_payload`, used until the server has said otherwise.
pub const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

/// Most messages in one atomic batch: nats-server's default
/// `max_batch_size` (a server configured lower refuses larger batches, and
/// the relay then publishes their rows one at a time).
pub const MAX_BATCH: usize = 1_000;

/// Atomic batches one sink has in flight at once. nats-server allows 50 per
/// stream (all publishers together) and 1,000 per server by default; a batch
/// refused for too many in flight is published one message at a time.
const BATCHES_IN_FLIGHT: usize = 8;

/// Room for the batch headers on top of [`JetStreamSink`]'s own:
/// `Nats-Batch-Id` (32 characters), `Nats-Batch-Sequence` (up to
/// [`MAX_BATCH`]) and `Nats-Batch-Commit`, with their framing.
const BATCH_HEADER_ROOM: usize = 128;

/// Publishes to NATS JetStream and awaits every PubAck: one per message, or
/// one per atomic batch into a stream that allows them
/// ([`Sink::publish_batch`]).
#[derive(Clone)]
pub struct JetStreamSink {
    client: async_nats::Client,
    context: jetstream::Context,
    timeout: Duration,
    expected_stream: Option<String>,
    view: Option<StreamView>,
    batches: Arc<Semaphore>,
}

impl fmt::Debug for JetStreamSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamSink")
            .field("timeout", &self.timeout)
            .field("expected_stream", &self.expected_stream)
            .field("view", &self.view)
            .finish_non_exhaustive()
    }
}

impl JetStreamSink {
    /// A sink on `client`, bounding each publish + ack by `timeout`.
    pub fn new(client: async_nats::Client, timeout: Duration) -> Self {
        let context = jetstream::ContextBuilder::new()
            .timeout(timeout)
            .build(client.clone());
        Self {
            client,
            context,
            timeout,
            expected_stream: None,
            view: None,
            batches: Arc::new(Semaphore::new(BATCHES_IN_FLIGHT)),
        }
    }

    /// Sends `Nats-Expected-Stream: stream`, so a subject captured by another
    /// stream is refused instead of stored in the wrong place.
    #[must_use]
    pub fn expect_stream(mut self, stream: impl Into<String>) -> Self {
        self.expected_stream = Some(stream.into());
        self
    }

    /// Judges messages by `view`, the stream's config kept up to date: a
    /// message on a subject the stream does not capture, read again, is
    /// refused as [`FailureKind::NotCaptured`] before it is sent (instead of
    /// being answered by "no responders", which looks like a broker fault);
    /// while the stream does not exist, as [`FailureKind::NoStream`]; a
    /// refusal by the broker is judged after reading the stream again (over
    /// its `max_msg_size`: [`FailureKind::TooLarge`]), and a message refused
    /// by a stream that has changed since is sent once more. Also sets
    /// `Nats-Expected-Stream` to the view's stream, as
    /// [`expect_stream`](Self::expect_stream) does.
    #[must_use]
    pub fn follow(mut self, view: StreamView) -> Self {
        self.expected_stream = Some(view.name().to_owned());
        self.view = Some(view);
        self
    }

    /// The JetStream context.
    pub fn context(&self) -> &jetstream::Context {
        &self.context
    }
}

impl JetStreamSink {
    /// Sends one message and awaits its PubAck (bounded by the caller).
    async fn send(
        &self,
        message: &OutgoingMessage,
        headers: HeaderMap,
    ) -> Result<PublishAck, Refusal> {
        let ack = self
            .context
            .publish_with_headers(message.subject.clone(), headers, message.payload.clone())
            .await
            .map_err(Refusal::from)?;
        let ack = ack.await.map_err(Refusal::from)?;
        Ok(PublishAck {
            stream: ack.stream,
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        })
    }

    /// Sends `messages` as one atomic batch (`Nats-Batch-Id`,
    /// `Nats-Batch-Sequence` from 1, `Nats-Batch-Commit: 1` on the last) and
    /// awaits the commit's PubAck, which carries the batch id, the count and
    /// the sequence of the last message (bounded by the caller).
    ///
    /// All but the last are sent without a reply subject, on the one
    /// connection, in order: the server stages them and answers only the
    /// commit. A message lost on the way (a reconnect between sends) leaves
    /// a gap in `Nats-Batch-Sequence`, for which the server abandons the
    /// batch and refuses the commit; none is stored.
    async fn send_batch(
        &self,
        messages: &[OutgoingMessage],
    ) -> Result<Vec<PublishAck>, PublishFailure> {
        let Some((last, rest)) = messages.split_last() else {
            return Ok(Vec::new());
        };
        let id = Uuid::now_v7().simple().to_string();
        let count = messages.len();
        for (i, message) in rest.iter().enumerate() {
            let mut headers = self.headers(message);
            headers.insert("Nats-Batch-Id", id.as_str());
            headers.insert("Nats-Batch-Sequence", (i + 1).to_string().as_str());
            self.client
                .publish_with_headers(message.subject.clone(), headers, message.payload.clone())
                .await
                .map_err(|e| {
                    // Nothing is committed without the last message.
                    let kind = match e.kind() {
                        async_nats::client::PublishErrorKind::Send => FailureKind::Unavailable,
                        _ => FailureKind::Rejected,
                    };
                    PublishFailure::new(kind, format!("sending message {} of a batch: {e}", i + 1))
                })?;
        }
        let mut headers = self.headers(last);
        headers.insert("Nats-Batch-Id", id.as_str());
        headers.insert("Nats-Batch-Sequence", count.to_string().as_str());
        headers.insert("Nats-Batch-Commit", "1");
        let ack = self
            .context
            .publish_with_headers(last.subject.clone(), headers, last.payload.clone())
            .await
            .map_err(batch_failure)?
            .await
            .map_err(batch_failure)?;
        let n = u64::try_from(count).unwrap_or(u64::MAX);
        if ack.batch_id.as_deref() != Some(id.as_str())
            || ack.batch_size != Some(n)
            || ack.sequence < n
            || ack.duplicate
        {
            // Not the commit of this batch: what was stored is found out by
            // publishing the messages one at a time (dedupe answers for any
            // already stored).
            return Err(PublishFailure::new(
                FailureKind::Rejected,
                format!(
                    "the server's ack ({ack:?}) is not the commit of batch {id} of {count} messages"
                ),
            ));
        }
        // A committed batch is stored contiguously: its messages are
        // applied one after the other under the stream's isolation lock (and
        // proposed as one entry range in a cluster), so message i is at
        // `last - count + 1 + i`.
        let first = ack.sequence - n + 1;
        Ok((0..n)
            .map(|i| PublishAck::new(ack.stream.clone(), first + i, false))
            .collect())
    }

    fn headers(&self, message: &OutgoingMessage) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let mut id = Uuid::encode_buffer();
        let id: &str = message.id.as_uuid().hyphenated().encode_lower(&mut id);
        headers.insert("Nats-Msg-Id", id);
        if let Some(stream) = &self.expected_stream {
            headers.insert("Nats-Expected-Stream", stream.as_str());
        }
        // The trace context comes from the row: checked when the row was
        // read (a CR or LF parks it), and again here, strictly, so no value
        // is ever sent altered.
        for (name, value) in [
            ("traceparent", &message.traceparent),
            ("tracestate", &message.tracestate),
        ] {
            let Some(value) = value else { continue };
            match HeaderValue::try_from(value.as_str()) {
                Ok(value) => headers.insert(name, value),
                Err(e) => tracing::warn!(
                    event_id = %message.id, header = name, error = %e,
                    "a trace header of the row cannot travel in NATS headers; published without it",
                ),
            }
        }
        headers
    }

    /// Publishes `message` as the stream is now (see [`JetStreamSink::follow`]).
    async fn publish_following(
        &self,
        view: &StreamView,
        message: OutgoingMessage,
    ) -> Result<PublishAck, PublishFailure> {
        if !view.captures(&message.subject) {
            let (config, _) = view.recheck().await.map_err(unreadable)?;
            uncaptured(view, config.as_deref(), &message.subject)?;
        }
        let headers = self.headers(&message);
        let size = wire_len(&headers) + message.payload.len();
        let refusal = match self.send(&message, headers.clone()).await {
            Ok(ack) => return Ok(ack),
            Err(refusal) if refusal.is_stream_refusal() => refusal,
            Err(refusal) => return Err(refusal.failure),
        };
        // Refused by the stream: judged by the stream as it is now (and not
        // at all while it cannot be read).
        let (config, change) = view.recheck().await.map_err(unreadable)?;
        uncaptured(view, config.as_deref(), &message.subject)?;
        let limit = config
            .as_deref()
            .map_or(0, |c| usize::try_from(c.max_message_size).unwrap_or(0));
        if refusal.code == Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM)
            && limit > 0
            && size > limit
        {
            return Err(PublishFailure::new(
                FailureKind::TooLarge,
                format!(
                    "the message is {size} bytes with headers, over the max_msg_size of {limit} \
                     bytes of stream `{}` (read again after it refused the message)",
                    view.name()
                ),
            ));
        }
        if change == Change::Changed {
            debug!(event_id = %message.id, stream = view.name(), "the stream changed under a refused publish; sending it again");
            return self
                .send(&message, headers)
                .await
                .map_err(|refusal| refusal.failure);
        }
        Err(refusal.failure)
    }
}

/// The stream could not be read to judge a row: a broker fault, at no cost
/// to the row.
fn unreadable(e: crate::Error) -> PublishFailure {
    PublishFailure::new(FailureKind::Unavailable, e.to_string())
}

/// `Err` unless the stream of `config` (as just read) exists and captures
/// `subject`.
fn uncaptured(
    view: &StreamView,
    config: Option<&jetstream::stream::Config>,
    subject: &str,
) -> Result<(), PublishFailure> {
    match config {
        None => Err(PublishFailure::new(
            FailureKind::NoStream,
            format!(
                "stream `{}` does not exist; waiting for it to be created again",
                view.name()
            ),
        )),
        Some(c) if !c.subjects.iter().any(|f| subject_matches(f, subject)) => {
            view.note_uncaptured(subject, c);
            Err(PublishFailure::new(
                FailureKind::NotCaptured,
                format!(
                    "event type `{subject}` is not captured by the stream `{}` (subjects {:?}); \
                     waiting, without counting attempts, until it is: `{}`",
                    view.name(),
                    c.subjects,
                    crate::stream::edit_command(c, &[subject.to_owned()])
                ),
            ))
        }
        Some(_) => Ok(()),
    }
}

/// The bytes the server counts against a stream's `max_msg_size` for these
/// headers: "NATS/1.0\r\n", each "name: value\r\n", then "\r\n".
fn wire_len(headers: &HeaderMap) -> usize {
    let mut len = "NATS/1.0\r\n".len() + "\r\n".len();
    for (name, values) in headers.iter() {
        for value in values {
            len +=
                AsRef::<str>::as_ref(name).len() + ": ".len() + value.as_str().len() + "\r\n".len();
        }
    }
    len
}

/// A failed send: how the relay treats it, and the JetStream error code if
/// the server answered with one.
struct Refusal {
    failure: PublishFailure,
    code: Option<ErrorCode>,
}

impl Refusal {
    /// Whether the answer may come from the stream's configuration (no
    /// stream answering, a refusal), so that reading the stream again can
    /// change the verdict.
    fn is_stream_refusal(&self) -> bool {
        matches!(
            self.failure.kind(),
            FailureKind::NoStream | FailureKind::Rejected
        )
    }
}

impl From<jetstream::context::PublishError> for Refusal {
    fn from(e: jetstream::context::PublishError) -> Self {
        let code = std::error::Error::source(&e)
            .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
            .map(async_nats::jetstream::Error::error_code);
        Self {
            failure: classify(e),
            code,
        }
    }
}

impl Sink for JetStreamSink {
    async fn publish(&self, message: OutgoingMessage) -> Result<PublishAck, PublishFailure> {
        if self.client.connection_state() != State::Connected {
            return Err(PublishFailure::new(
                FailureKind::Unavailable,
                "not connected to NATS",
            ));
        }
        // One bound on the whole publish: re-reads and a second send included.
        let send = async {
            match &self.view {
                Some(view) => self.publish_following(view, message).await,
                None => {
                    let headers = self.headers(&message);
                    self.send(&message, headers).await.map_err(|r| r.failure)
                }
            }
        };
        match tokio::time::timeout(self.timeout, send).await {
            Ok(result) => result,
            Err(_) => Err(PublishFailure::new(
                FailureKind::Timeout,
                format!("no ack within {}", outbox_pg::HumanDuration(self.timeout)),
            )),
        }
    }

    /// Batches only into a stream that, as last read from the server, has
    /// `allow_atomic` on (a server before 2.12 does not know the setting and
    /// never reports it, so its streams are never sent a batch: it would
    /// store the messages one by one, unanswered), and only messages it
    /// captures and whose size, with the batch headers, fits the server's
    /// `max_payload` and the stream's `max_msg_size`.
    fn batch_len(&self, messages: &[OutgoingMessage]) -> usize {
        let Some(config) = self.view.as_ref().and_then(StreamView::config) else {
            return 0;
        };
        // With every batch slot taken, rows go one at a time rather than
        // wait for one.
        if !config.allow_atomic_publish
            || !self.is_available()
            || self.batches.available_permits() == 0
        {
            return 0;
        }
        let mut limit = self.max_payload();
        if let Ok(max) = usize::try_from(config.max_message_size)
            && max > 0
        {
            limit = limit.min(max);
        }
        messages
            .iter()
            .take(MAX_BATCH)
            .take_while(|m| {
                config
                    .subjects
                    .iter()
                    .any(|f| subject_matches(f, &m.subject))
                    && wire_len(&self.headers(m)) + BATCH_HEADER_ROOM + m.payload.len() <= limit
            })
            .count()
    }

    async fn publish_batch(
        &self,
        messages: Vec<OutgoingMessage>,
    ) -> Result<Vec<PublishAck>, PublishFailure> {
        if self.client.connection_state() != State::Connected {
            return Err(PublishFailure::new(
                FailureKind::Unavailable,
                "not connected to NATS",
            ));
        }
        let Ok(_permit) = self.batches.acquire().await else {
            return Err(PublishFailure::new(
                FailureKind::Unavailable,
                "the sink is shutting down",
            ));
        };
        match tokio::time::timeout(self.timeout, self.send_batch(&messages)).await {
            Ok(result) => result,
            Err(_) => Err(PublishFailure::new(
                FailureKind::Timeout,
                format!(
                    "no ack of the batch's commit within {}",
                    outbox_pg::HumanDuration(self.timeout)
                ),
            )),
        }
    }

    fn is_available(&self) -> bool {
        self.client.connection_state() == State::Connected
    }

    fn is_closed(&self) -> bool {
        outbox_pg::nats::is_closed(&self.client)
    }

    fn max_payload(&self) -> usize {
        match self.client.server_info().max_payload {
            0 => DEFAULT_MAX_PAYLOAD,
            n => n,
        }
    }

    async fn refresh(&self) {
        if let Some(view) = &self.view
            && let Err(e) = view.refresh().await
        {
            debug!(stream = view.name(), error = %e, "periodic re-read of the stream failed");
        }
    }
}

/// A batch's commit answered by an error: whatever the server stored of the
/// batch is a prefix of it (nothing, for the refusals the server checks
/// before it stores; the messages before a store failure otherwise), so its
/// messages can be published one at a time, where dedupe answers for those
/// stored and each refusal is judged for its own message:
/// [`FailureKind::Rejected`]. A commit not answered (no ack in time, not
/// connected, no stream) is classified as a single publish is.
fn batch_failure(e: jetstream::context::PublishError) -> PublishFailure {
    let answered = std::error::Error::source(&e)
        .is_some_and(|source| source.is::<async_nats::jetstream::Error>());
    if answered {
        PublishFailure::new(
            FailureKind::Rejected,
            format!("the stream refused the batch: {e}"),
        )
    } else {
        classify(e)
    }
}

fn classify(e: jetstream::context::PublishError) -> PublishFailure {
    let kind = match e.kind() {
        PublishErrorKind::TimedOut => FailureKind::Timeout,
        PublishErrorKind::BrokenPipe => FailureKind::Unavailable,
        // The server answers "no responders" when no stream captures the subject.
        PublishErrorKind::StreamNotFound => FailureKind::NoStream,
        PublishErrorKind::MaxPayloadExceeded => FailureKind::TooLarge,
        // A cluster between leaders answers for the stream with a 503 or a
        // "not leader / not available" error: the broker's state, which heals.
        PublishErrorKind::Other if is_cluster_unavailable(&e) => FailureKind::Unavailable,
        // Stream errors (wrong expected stream, limits) and anything new.
        _ => FailureKind::Rejected,
    };
    PublishFailure::new(kind, e.to_string())
}

/// Whether the PubAck was a JetStream API error saying the cluster cannot
/// serve the stream right now (503, or no leader, peers or quorum), as during
/// a leader election, rather than a refusal of the message.
fn is_cluster_unavailable(e: &jetstream::context::PublishError) -> bool {
    use async_nats::jetstream::ErrorCode;
    std::error::Error::source(e)
        .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|api| {
            api.code() == 503
                || [
                    ErrorCode::CLUSTER_INCOMPLETE,
                    ErrorCode::CLUSTER_NO_PEERS,
                    ErrorCode::CLUSTER_NOT_ACTIVE,
                    ErrorCode::CLUSTER_NOT_ASSIGNED,
                    ErrorCode::CLUSTER_NOT_AVAILABLE,
                    ErrorCode::CLUSTER_NOT_LEADER,
                ]
                .contains(&api.error_code())
        })
}

#[cfg(test)]
mod tests {
    use async_nats::jetstream::context::{PublishError, PublishErrorKind};

    use super::{FailureKind, HeaderMap, batch_failure, classify, wire_len};

    fn api_error(json: &str) -> PublishError {
        let api: async_nats::jetstream::Error = serde_json::from_str(json).unwrap();
        PublishError::with_source(PublishErrorKind::Other, api)
    }

    #[test]
    fn a_cluster_between_leaders_is_a_broker_fault_and_a_refusal_is_not() {
        for json in [
            r#"{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}"#,
            r#"{"code":500,"err_code":10009,"description":"JetStream cluster can not handle request"}"#,
        ] {
            let failure = classify(api_error(json));
            assert_eq!(failure.kind(), FailureKind::Unavailable, "{json}");
            assert!(failure.kind().is_broker_fault());
        }
        let wrong_stream = classify(api_error(
            r#"{"code":400,"err_code":10060,"description":"expected stream does not match"}"#,
        ));
        assert_eq!(wrong_stream.kind(), FailureKind::Rejected);
        assert!(!wrong_stream.kind().is_broker_fault());
        assert_eq!(
            classify(PublishError::new(PublishErrorKind::StreamNotFound)).kind(),
            FailureKind::NoStream
        );
    }

    #[test]
    fn an_answered_batch_is_a_refusal_and_an_unanswered_one_a_broker_fault() {
        for json in [
            r#"{"code":400,"err_code":10201,"description":"atomic publish batch contains duplicate message id"}"#,
            r#"{"code":503,"err_code":10077,"description":"maximum bytes exceeded"}"#,
        ] {
            assert_eq!(
                batch_failure(api_error(json)).kind(),
                FailureKind::Rejected,
                "{json}"
            );
        }
        assert_eq!(
            batch_failure(PublishError::new(PublishErrorKind::TimedOut)).kind(),
            FailureKind::Timeout
        );
        assert_eq!(
            batch_failure(PublishError::new(PublishErrorKind::StreamNotFound)).kind(),
            FailureKind::NoStream
        );
    }

    #[test]
    fn not_captured_and_broker_faults_cost_no_attempt() {
        assert!(!FailureKind::NotCaptured.counts_as_attempt());
        assert!(!FailureKind::NotCaptured.is_permanent());
        assert!(!FailureKind::NotCaptured.is_broker_fault());
        assert!(!FailureKind::NoStream.counts_as_attempt());
        assert!(FailureKind::Rejected.counts_as_attempt());
        assert!(FailureKind::TooLarge.counts_as_attempt());
    }

    #[test]
    fn header_bytes_are_counted_as_the_server_counts_them() {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", "abc");
        // "NATS/1.0\r\n" + "Nats-Msg-Id: abc\r\n" + "\r\n"
        assert_eq!(wire_len(&headers), 10 + 18 + 2);
    }
}
