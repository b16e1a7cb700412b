//! The request that travels through the service stack: one delivery of one
//! event, and the transaction it is handled in.
//!
//! A [`Delivery`] is the decoded envelope (payload still untyped: each handler
//! decodes `data` into its own type, see
//! [`HandlerService`](crate::HandlerService)) plus JetStream delivery metadata.
//! Inside [`Dedupe`](crate::dedupe::Dedupe) the request becomes an
//! [`InTx<Delivery>`]: the same delivery and the open transaction that the
//! inbox row, the handler's effects and any follow-on outbox events commit in.

use std::sync::Arc;

use async_nats::jetstream;
use outbox_pg::{Envelope, EventId, EventType};
use serde_json::Value;
use sqlx::PgTransaction;

use crate::error::{Error, ErrorKind};
use crate::fence::FenceKey;
use crate::poison::{Poison, Reason};

/// Header carrying the W3C trace parent of the publisher.
pub const TRACEPARENT_HEADER: &str = "traceparent";
/// Header carrying the W3C trace state of the publisher.
pub const TRACESTATE_HEADER: &str = "tracestate";

/// JetStream facts about one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeliveryInfo {
    /// The consumer (durable) name; also the inbox dedupe namespace.
    pub consumer: String,
    /// The stream the message is stored in.
    pub stream: String,
    /// The message's sequence in the stream.
    pub stream_sequence: u64,
    /// The consumer's delivery sequence.
    pub consumer_sequence: u64,
    /// How many times this message has been delivered, this time included (1 = first).
    pub delivered: u64,
    /// The NATS subject the message was published on (the event type).
    pub nats_subject: String,
}

impl DeliveryInfo {
    /// Metadata for a first delivery to `consumer`, with empty stream facts;
    /// for tests and hand-driven stacks. Set the public fields as needed.
    pub fn new(consumer: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
            stream: String::new(),
            stream_sequence: 0,
            consumer_sequence: 0,
            delivered: 1,
            nats_subject: String::new(),
        }
    }

    /// Reads the metadata JetStream encodes in a message's reply subject.
    ///
    /// # Errors
    /// [`ErrorKind::Nats`] if the message did not come from a JetStream consumer.
    pub fn from_message(message: &jetstream::Message) -> Result<Self, Error> {
        let info = message.info().map_err(|e| {
            Error::caused(ErrorKind::Nats, "message carries no JetStream metadata", e)
        })?;
        Ok(Self {
            consumer: info.consumer.to_owned(),
            stream: info.stream.to_owned(),
            stream_sequence: info.stream_sequence,
            consumer_sequence: info.consumer_sequence,
            delivered: u64::try_from(info.delivered).unwrap_or(1).max(1),
            nats_subject: message.subject.to_string(),
        })
    }
}

/// One delivery of one event: the envelope and where it came from.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Shared: a delivery is cloned for each attempt of its batch, and the
    /// payload is decoded from a borrow ([`typed`](crate::typed) of a clone
    /// copies it only when another clone is still held).
    envelope: Arc<Envelope<Value>>,
    /// Shared too, as the trace headers: a clone copies no string.
    info: Arc<DeliveryInfo>,
    traceparent: Option<Arc<str>>,
    tracestate: Option<Arc<str>>,
    leader_epoch: Option<i64>,
    /// The keys of the leader's fence, when the runtime marked the delivery.
    fence_key: Option<FenceKey>,
    /// The span to handle the delivery in, when it is not the current one
    /// (batch mode: see [`crate::trace`]).
    span: Option<tracing::Span>,
}

impl Delivery {
    /// A delivery of `envelope`, for tests and custom runtimes.
    pub fn new(envelope: Envelope<Value>, info: DeliveryInfo) -> Self {
        Self {
            envelope: Arc::new(envelope),
            info: Arc::new(info),
            traceparent: None,
            tracestate: None,
            leader_epoch: None,
            fence_key: None,
            span: None,
        }
    }

    /// Decodes a JetStream message: the body must be a CloudEvents 1.0
    /// structured-mode JSON envelope (as `outbox_pg::Envelope::to_json`
    /// writes), and the `traceparent` / `tracestate` headers are kept.
    ///
    /// # Errors
    /// A [`Poison`] naming why the message can never be handled: not JSON, not a
    /// CloudEvent, no valid id. The runtime dead-letters it.
    pub fn from_message(message: &jetstream::Message) -> Result<Self, Poison> {
        let info = DeliveryInfo::from_message(message)
            .map_err(|e| Poison::new(Reason::NotCloudEvent, e))?;
        Self::decode(message, info)
    }

    /// [`from_message`](Self::from_message) with the JetStream metadata
    /// already read.
    pub(crate) fn decode(message: &jetstream::Message, info: DeliveryInfo) -> Result<Self, Poison> {
        Self::decode_nats(&message.message, info)
    }

    /// [`decode`](Self::decode) of the NATS message a JetStream message wraps:
    /// the body and the trace headers are all it reads.
    fn decode_nats(message: &async_nats::Message, info: DeliveryInfo) -> Result<Self, Poison> {
        let envelope = decode_envelope(&message.payload)?;
        Ok(Self::from_decoded(message, envelope, info))
    }

    /// A delivery of `envelope`, decoded from `message`'s body already: the
    /// trace headers are read from the message.
    pub(crate) fn from_decoded(
        message: &async_nats::Message,
        envelope: Envelope<Value>,
        info: DeliveryInfo,
    ) -> Self {
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| Arc::from(v.as_str()))
        };
        Self {
            traceparent: header(TRACEPARENT_HEADER),
            tracestate: header(TRACESTATE_HEADER),
            envelope: Arc::new(envelope),
            info: Arc::new(info),
            leader_epoch: None,
            fence_key: None,
            span: None,
        }
    }

    /// Marks the delivery as handled by the leader of an ordered consumer in
    /// `epoch` (the runtime does this): [`Dedupe`](crate::Dedupe) then checks,
    /// just before it commits, that the epoch is still current, and rolls back
    /// with [`ErrorKind::LeaseLost`] if another replica took the lead.
    #[must_use]
    pub fn with_leader_epoch(mut self, epoch: i64) -> Self {
        self.leader_epoch = Some(epoch);
        self
    }

    /// The leader epoch this delivery is fenced by, if any.
    pub fn leader_epoch(&self) -> Option<i64> {
        self.leader_epoch
    }

    /// Marks the delivery as the leader's in `epoch`, with the keys of its
    /// fence (read once per tenure), so the check before the commit needs
    /// no catalog lookup.
    #[must_use]
    pub(crate) fn with_fence(mut self, epoch: i64, key: FenceKey) -> Self {
        self.leader_epoch = Some(epoch);
        self.fence_key = Some(key);
        self
    }

    /// The epoch the delivery is fenced by and, when the runtime marked it,
    /// the fence's keys.
    pub(crate) fn fence(&self) -> Option<(i64, Option<FenceKey>)> {
        self.leader_epoch.map(|epoch| (epoch, self.fence_key))
    }

    /// Names the span the delivery's handler runs in (the batch
    /// [`Trace`](crate::Trace) does, where deliveries are handled inside one
    /// batch span rather than each inside its own).
    pub(crate) fn in_span(mut self, span: tracing::Span) -> Self {
        self.span = Some(span);
        self
    }

    /// The span the delivery's handler runs in, if not the current one.
    pub(crate) fn span(&self) -> Option<&tracing::Span> {
        self.span.as_ref()
    }

    /// Overrides the trace context (normally read from the message headers).
    #[must_use]
    pub fn with_trace_context(
        mut self,
        traceparent: Option<String>,
        tracestate: Option<String>,
    ) -> Self {
        self.traceparent = traceparent.map(Arc::from);
        self.tracestate = tracestate.map(Arc::from);
        self
    }

    /// The envelope, payload untyped.
    pub fn envelope(&self) -> &Envelope<Value> {
        &self.envelope
    }

    /// The envelope, shared (for the runtime's bookkeeping of what a task holds).
    pub(crate) fn shared_envelope(&self) -> Arc<Envelope<Value>> {
        Arc::clone(&self.envelope)
    }

    /// Consumes the delivery, returning the envelope.
    pub fn into_envelope(self) -> Envelope<Value> {
        Arc::unwrap_or_clone(self.envelope)
    }

    /// JetStream metadata.
    pub fn info(&self) -> &DeliveryInfo {
        &self.info
    }

    /// The consumer name: the dedupe namespace.
    pub fn consumer(&self) -> &str {
        &self.info.consumer
    }

    /// The event id.
    pub fn id(&self) -> EventId {
        self.envelope.id()
    }

    /// The event type.
    pub fn event_type(&self) -> &EventType {
        self.envelope.event_type()
    }

    /// The entity the event is about (the envelope's `subject`, not the NATS subject).
    pub fn subject(&self) -> &str {
        self.envelope.subject()
    }

    /// The publisher's W3C `traceparent`: the message header, else the envelope attribute.
    pub fn traceparent(&self) -> Option<&str> {
        self.traceparent
            .as_deref()
            .or_else(|| self.envelope.traceparent())
    }

    /// The publisher's W3C `tracestate`: the message header, else the envelope attribute.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate
            .as_deref()
            .or_else(|| self.envelope.tracestate())
    }
}

/// Decodes an envelope, naming precisely why a body is poison.
pub(crate) fn decode_envelope(bytes: &[u8]) -> Result<Envelope<Value>, Poison> {
    Envelope::<Value>::from_json(bytes).map_err(|e| {
        let (reason, event_id) = classify(bytes);
        let poison = Poison::new(
            reason,
            Error::new(ErrorKind::InvalidEnvelope, e.to_string()).with_source(e),
        );
        match event_id {
            Some(id) => poison.with_event_id(id),
            None => poison,
        }
    })
}

/// Why a body that failed to decode is poison, and its id when it has a valid one.
fn classify(bytes: &[u8]) -> (Reason, Option<EventId>) {
    let Ok(value) = serde_json::from_slice::<Value>(bytes) else {
        return (Reason::NotJson, None);
    };
    let Some(object) = value.as_object() else {
        return (Reason::NotCloudEvent, None);
    };
    if !object.contains_key("specversion") {
        return (Reason::NotCloudEvent, None);
    }
    match object
        .get("id")
        .and_then(Value::as_str)
        .and_then(|s| s.parse::<EventId>().ok())
    {
        Some(id) => (Reason::NotCloudEvent, Some(id)),
        None => (Reason::InvalidId, None),
    }
}

/// The outcome of handling a delivery. Every outcome is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its effects committed with the inbox row.
    Handled,
    /// The inbox already held the event for this consumer: the handler was skipped.
    Duplicate,
    /// A newer event of the same subject was already applied: the handler was
    /// skipped, and the inbox row committed (a redelivery is a
    /// [`Duplicate`](Self::Duplicate)). Newer means, for an event with a
    /// `sequence`, an applied event with a higher sequence (events without one
    /// are not compared with it); for an event without one, an applied event
    /// with a later `time`. Sequences order the events of one outbox database
    /// only: events of one subject from two producers' databases are not
    /// comparable. See [`SkipStale`](crate::ordering::SkipStale).
    Stale,
}

impl Outcome {
    /// A short lowercase name, for logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Handled => "handled",
            Self::Duplicate => "duplicate",
            Self::Stale => "stale",
        }
    }
}

/// What a batch service answers: one result per delivery, in the batch's
/// order (see [`Consumer::run_batched`](crate::Consumer::run_batched)).
pub type BatchResults = Vec<Result<Outcome, crate::error::BoxError>>;

/// What the runtime asks of a stack: one [`Delivery`] (answered with an
/// [`Outcome`]), or a batch, `Vec<Delivery>` (answered with
/// [`BatchResults`]). [`Metrics`](crate::Metrics) serves both through it,
/// with one implementation; [`Trace`](crate::Trace) reads each delivery's
/// result through it.
pub trait Deliveries: Send + 'static {
    /// What the stack answers.
    type Response;

    /// The deliveries asked for, in order.
    fn deliveries(&self) -> &[Delivery];

    /// Each delivery's result in `response`, in order: its outcome, or its
    /// own error. (A request that fails as a whole fails every delivery.)
    fn results(
        response: &Self::Response,
    ) -> impl Iterator<Item = Result<Outcome, &crate::error::BoxError>>;
}

impl Deliveries for Delivery {
    type Response = Outcome;

    fn deliveries(&self) -> &[Delivery] {
        std::slice::from_ref(self)
    }

    fn results(
        response: &Outcome,
    ) -> impl Iterator<Item = Result<Outcome, &crate::error::BoxError>> {
        std::iter::once(Ok(*response))
    }
}

impl Deliveries for Vec<Delivery> {
    type Response = BatchResults;

    fn deliveries(&self) -> &[Delivery] {
        self
    }

    fn results(
        response: &BatchResults,
    ) -> impl Iterator<Item = Result<Outcome, &crate::error::BoxError>> {
        response.iter().map(|result| result.as_ref().copied())
    }
}

/// A value travelling with the open transaction it belongs to.
///
/// Services inside [`Dedupe`](crate::dedupe::Dedupe) take an
/// `InTx<Delivery>` and hand the transaction back in an `InTx<Outcome>`; the
/// dedupe service commits it. Dropping it rolls the transaction back.
#[derive(Debug)]
pub struct InTx<T> {
    tx: PgTransaction<'static>,
    value: T,
}

impl<T> InTx<T> {
    /// Pairs `value` with `tx`.
    pub fn new(tx: PgTransaction<'static>, value: T) -> Self {
        Self { tx, value }
    }

    /// The value.
    pub fn get_ref(&self) -> &T {
        &self.value
    }

    /// The transaction.
    pub fn tx(&mut self) -> &mut PgTransaction<'static> {
        &mut self.tx
    }

    /// The transaction and the value, borrowed together.
    pub fn parts_mut(&mut self) -> (&mut PgTransaction<'static>, &mut T) {
        (&mut self.tx, &mut self.value)
    }

    /// Splits into the transaction and the value.
    pub fn into_parts(self) -> (PgTransaction<'static>, T) {
        (self.tx, self.value)
    }

    /// Replaces the value, keeping the transaction.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> InTx<U> {
        InTx {
            tx: self.tx,
            value: f(self.value),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poison_is_classified() {
        let cases: &[(&[u8], Reason)] = &[
            (b"not json", Reason::NotJson),
            (b"\xff", Reason::NotJson),
            (b"[1]", Reason::NotCloudEvent),
            (br#"{"hello":"world"}"#, Reason::NotCloudEvent),
            (
                br#"{"specversion":"1.0","source":"s","type":"a","subject":"s","time":"2026-01-01T00:00:00Z"}"#,
                Reason::InvalidId,
            ),
            (
                br#"{"specversion":"1.0","id":"nope","source":"s","type":"a","subject":"s","time":"2026-01-01T00:00:00Z"}"#,
                Reason::InvalidId,
            ),
            (
                br#"{"specversion":"1.0","id":"0190a5f2-7c3e-7000-8000-000000000000","source":"s","type":"a b","subject":"s","time":"2026-01-01T00:00:00Z"}"#,
                Reason::NotCloudEvent,
            ),
        ];
        for (bytes, reason) in cases {
            let poison = decode_envelope(bytes).unwrap_err();
            assert_eq!(
                poison.reason(),
                *reason,
                "{:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn a_valid_envelope_decodes() {
        let env = Envelope::new("a.b", "svc", "s1", serde_json::json!({"x": 1})).unwrap();
        let back = decode_envelope(&env.to_json().unwrap()).unwrap();
        assert_eq!(back.id(), env.id());
    }
}

/// Property tests: a message body or header of any shape decodes to a
/// [`Delivery`] or is [`Poison`] with a reason, never a panic.
#[cfg(test)]
mod proptests {
    use std::str::FromStr;

    use async_nats::header::{HeaderMap, HeaderName, HeaderValue};
    use async_nats::{StatusCode, Subject};
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;
    use serde_json::{Map, json};

    use super::*;

    fn config() -> ProptestConfig {
        ProptestConfig {
            failure_persistence: None,
            ..ProptestConfig::with_cases(512)
        }
    }

    const ID: &str = "0190a5f2-7c3e-7000-8000-000000000000";

    const ATTRIBUTES: &[&str] = &[
        "specversion",
        "id",
        "source",
        "type",
        "subject",
        "time",
        "datacontenttype",
        "traceparent",
        "tracestate",
        "sequence",
        "data",
    ];

    fn valid() -> Map<String, Value> {
        let Value::Object(object) = json!({
            "specversion": "1.0",
            "id": ID,
            "source": "subscriptions",
            "type": "subscription.created",
            "subject": "sub_1",
            "time": "2026-11-30T10:00:00Z",
            "datacontenttype": "application/json",
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "sequence": "42",
            "data": {"plan": "pro"},
        }) else {
            unreachable!()
        };
        object
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            any::<String>().prop_map(Value::String),
        ];
        leaf.prop_recursive(6, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
                prop::collection::btree_map(any::<String>(), inner, 0..8)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn attribute_value() -> impl Strategy<Value = Value> {
        prop_oneof![
            any::<String>().prop_map(Value::String),
            "[0-9a-fA-F-]{0,40}".prop_map(Value::String),
            "[+-]?[0-9]{1,6}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{0,12})?Z"
                .prop_map(Value::String),
            arb_json(),
        ]
    }

    /// The valid envelope with each named attribute replaced (`Some`) or
    /// removed (`None`).
    fn near_valid() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(
            (
                prop::sample::select(ATTRIBUTES),
                prop::option::of(attribute_value()),
            ),
            1..4,
        )
        .prop_map(|changes| {
            let mut object = valid();
            for (name, value) in changes {
                match value {
                    Some(value) => object.insert(name.to_owned(), value),
                    None => object.remove(name),
                };
            }
            serde_json::to_vec(&Value::Object(object)).unwrap()
        })
    }

    /// A body: any bytes, any JSON, or an envelope with attributes changed.
    fn body() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..256),
            arb_json().prop_map(|v| serde_json::to_vec(&v).unwrap()),
            near_valid(),
        ]
    }

    /// `decode_envelope`'s answer agrees with `Envelope::from_json`, and a
    /// poison's reason and id with what the body holds.
    fn decodes_or_is_poison(bytes: &[u8]) -> Result<(), TestCaseError> {
        let decoded = decode_envelope(bytes);
        match (&decoded, Envelope::<Value>::from_json(bytes)) {
            (Ok(env), Ok(expected)) => prop_assert_eq!(env, &expected),
            (Err(_), Err(_)) => {}
            (d, e) => prop_assert!(false, "decode_envelope {:?}, from_json {:?}", d, e),
        }
        let Err(poison) = decoded else {
            return Ok(());
        };
        prop_assert!(!poison.to_string().is_empty());
        let json = serde_json::from_slice::<Value>(bytes).ok();
        let object = json.as_ref().and_then(Value::as_object);
        let id = object
            .and_then(|o| o.get("id"))
            .and_then(Value::as_str)
            .and_then(|s| s.parse::<EventId>().ok());
        match poison.reason() {
            Reason::NotJson => prop_assert!(json.is_none()),
            Reason::InvalidId => {
                prop_assert!(object.is_some_and(|o| o.contains_key("specversion")));
                prop_assert!(id.is_none());
            }
            Reason::NotCloudEvent => prop_assert!(json.is_some()),
            other => prop_assert!(false, "reason {other}"),
        }
        prop_assert_eq!(
            poison.event_id(),
            id.filter(|_| object.is_some_and(|o| o.contains_key("specversion")))
        );
        Ok(())
    }

    fn headers() -> impl Strategy<Value = Option<HeaderMap>> {
        let name = prop_oneof![
            Just(TRACEPARENT_HEADER.to_owned()),
            Just(TRACESTATE_HEADER.to_owned()),
            "[!-~]{1,16}",
            any::<String>(),
        ];
        prop::option::of(prop::collection::vec((name, any::<String>()), 0..6)).prop_map(|pairs| {
            pairs.map(|pairs| {
                let mut map = HeaderMap::new();
                for (name, value) in pairs {
                    // Names the client could not have read are left out.
                    if let Ok(name) = HeaderName::from_str(&name) {
                        map.append(name, HeaderValue::from_lossy(&value));
                    }
                }
                map
            })
        })
    }

    fn message() -> impl Strategy<Value = async_nats::Message> {
        (
            any::<String>(),
            prop::option::of(any::<String>()),
            body(),
            headers(),
            prop::option::of(any::<u16>()),
            prop::option::of(any::<String>()),
            any::<usize>(),
        )
            .prop_map(
                |(subject, reply, payload, headers, status, description, length)| {
                    async_nats::Message {
                        subject: Subject::from(subject),
                        reply: reply.map(Subject::from),
                        payload: payload.into(),
                        headers,
                        status: status.and_then(|s| StatusCode::from_u16(s).ok()),
                        description,
                        length,
                    }
                },
            )
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn any_bytes_decode_or_are_poison(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            decodes_or_is_poison(&bytes)?;
        }

        #[test]
        fn any_json_value_decodes_or_is_poison(value in arb_json()) {
            let bytes = serde_json::to_vec(&value).unwrap();
            decodes_or_is_poison(&bytes)?;
            prop_assert!(decode_envelope(&bytes).err().is_none_or(|p| p.reason() != Reason::NotJson));
        }

        #[test]
        fn an_envelope_with_attributes_replaced_or_removed_decodes_or_is_poison(
            bytes in near_valid(),
        ) {
            decodes_or_is_poison(&bytes)?;
        }

        #[test]
        fn an_envelope_with_any_id_keeps_the_id_when_it_is_a_uuid(
            id in prop_oneof![any::<String>(), "[0-9a-fA-F-]{0,40}"],
            break_type in any::<bool>(),
        ) {
            let mut object = valid();
            object.insert("id".into(), Value::String(id.clone()));
            if break_type {
                object.insert("type".into(), json!("a b"));
            }
            let bytes = serde_json::to_vec(&Value::Object(object)).unwrap();
            decodes_or_is_poison(&bytes)?;
            let uuid = id.parse::<EventId>().ok();
            match decode_envelope(&bytes) {
                Ok(env) => prop_assert_eq!(Some(env.id()), uuid),
                Err(poison) => {
                    prop_assert_eq!(poison.event_id(), uuid);
                    let reason = if uuid.is_some() { Reason::NotCloudEvent } else { Reason::InvalidId };
                    prop_assert_eq!(poison.reason(), reason);
                }
            }
        }

        #[test]
        fn a_message_of_any_shape_decodes_or_is_poison(message in message()) {
            match Delivery::decode_nats(&message, DeliveryInfo::new("c")) {
                Ok(delivery) => {
                    let header = |name: &str| {
                        message.headers.as_ref().and_then(|h| h.get(name)).map(HeaderValue::as_str)
                    };
                    prop_assert_eq!(
                        delivery.traceparent(),
                        header(TRACEPARENT_HEADER).or(delivery.envelope().traceparent())
                    );
                    prop_assert_eq!(
                        delivery.tracestate(),
                        header(TRACESTATE_HEADER).or(delivery.envelope().tracestate())
                    );
                    prop_assert_eq!(delivery.consumer(), "c");
                }
                Err(_) => decodes_or_is_poison(&message.payload)?,
            }
        }
    }
}
