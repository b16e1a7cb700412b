//! Where events go: the [`Sink`] trait and its JetStream implementation.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind};
use async_nats::{HeaderMap, connection::State};
use bytes::Bytes;
use outbox_pg::EventId;

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
    /// No stream captures the subject.
    NoStream,
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

    /// The largest message (payload and headers) the broker accepts; larger
    /// rows are parked without being fetched whole.
    fn max_payload(&self) -> usize {
        DEFAULT_MAX_PAYLOAD
    }
}

/// NATS' default `max_payload`, used until the server has said otherwise.
pub const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;

/// Publishes to NATS JetStream and awaits every PubAck.
#[derive(Clone)]
pub struct JetStreamSink {
    client: async_nats::Client,
    context: jetstream::Context,
    timeout: Duration,
    expected_stream: Option<String>,
    captures: Option<Vec<String>>,
}

impl fmt::Debug for JetStreamSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamSink")
            .field("timeout", &self.timeout)
            .field("expected_stream", &self.expected_stream)
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
            captures: None,
        }
    }

    /// Sends `Nats-Expected-Stream: stream`, so a subject captured by another
    /// stream is refused instead of stored in the wrong place.
    #[must_use]
    pub fn expect_stream(mut self, stream: impl Into<String>) -> Self {
        self.expected_stream = Some(stream.into());
        self
    }

    /// The subjects the stream captures: a message on any other subject is
    /// refused as [`FailureKind::Invalid`] before it is sent, instead of being
    /// answered by "no responders", which looks like a broker fault.
    #[must_use]
    pub fn captures(mut self, subjects: Vec<String>) -> Self {
        self.captures = Some(subjects);
        self
    }

    /// The JetStream context.
    pub fn context(&self) -> &jetstream::Context {
        &self.context
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
        if let Some(filters) = &self.captures
            && !filters.iter().any(|f| subject_matches(f, &message.subject))
        {
            return Err(PublishFailure::new(
                FailureKind::Invalid,
                format!(
                    "event type `{}` is not captured by the stream{} (subjects {filters:?})",
                    message.subject,
                    self.expected_stream
                        .as_deref()
                        .map(|s| format!(" `{s}`"))
                        .unwrap_or_default()
                ),
            ));
        }
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", message.id.to_string().as_str());
        if let Some(stream) = &self.expected_stream {
            headers.insert("Nats-Expected-Stream", stream.as_str());
        }
        if let Some(tp) = &message.traceparent {
            headers.insert("traceparent", tp.as_str());
        }
        if let Some(ts) = &message.tracestate {
            headers.insert("tracestate", ts.as_str());
        }
        let send = async {
            let ack = self
                .context
                .publish_with_headers(message.subject, headers, message.payload)
                .await
                .map_err(classify)?;
            ack.await.map_err(classify)
        };
        match tokio::time::timeout(self.timeout, send).await {
            Ok(Ok(ack)) => Ok(PublishAck {
                stream: ack.stream,
                sequence: ack.sequence,
                duplicate: ack.duplicate,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(PublishFailure::new(
                FailureKind::Timeout,
                format!("no ack within {:?}", self.timeout),
            )),
        }
    }

    fn is_available(&self) -> bool {
        self.client.connection_state() == State::Connected
    }

    fn max_payload(&self) -> usize {
        match self.client.server_info().max_payload {
            0 => DEFAULT_MAX_PAYLOAD,
            n => n,
        }
    }
}

/// Whether NATS subject `subject` matches `filter` (`*` one token, `>` the rest).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
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

    use super::{FailureKind, classify, subject_matches};

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
    fn filters_match_like_nats() {
        assert!(subject_matches("a.>", "a.b"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(subject_matches("a.b", "a.b"));
        assert!(!subject_matches("a.b", "a.c"));
        assert!(subject_matches(">", "x.y"));
    }
}
