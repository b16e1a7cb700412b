//! Dead letters: messages that will never be handled, kept with their raw
//! bytes, headers and the reason, then terminated (`AckKind::Term`).
//!
//! A dead letter is written to `inbox_dead_letters` (migration
//! `20260101000003_inbox_dead_letters.sql`) and, when a DLQ subject is
//! configured, also published there with its original headers plus
//! `Inbox-Dead-Letter-Reason`, `Inbox-Consumer`, `Inbox-Stream` and
//! `Inbox-Stream-Sequence`. Only once both succeeded is the message
//! terminated; if either fails the message is nak'ed and dead-lettering is
//! tried again on redelivery, so poison is never dropped silently. A lost
//! `Term` can therefore leave two rows for one message: rows are keyed by a
//! serial id, not by the message.

use std::fmt;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use outbox_core::EventId;
use serde_json::{Map, Value};
use sqlx::PgPool;

use crate::delivery::DeliveryInfo;
use crate::error::{Error, ErrorKind};

const INSERT_DEAD_LETTER: &str = include_str!("../queries/insert_dead_letter.sql");

/// Header naming the [`Reason`] on a message republished to the DLQ subject.
pub const REASON_HEADER: &str = "Inbox-Dead-Letter-Reason";

/// Why a message was dead-lettered. Stored as [`Reason::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// The body is not JSON.
    NotJson,
    /// The body is JSON but not a CloudEvents 1.0 structured-mode envelope with
    /// valid attributes (spec version, type, source, subject, time).
    NotCloudEvent,
    /// The envelope has no id, or one that is not a UUID.
    InvalidId,
    /// `data` does not decode as the handler's message type.
    UndecodablePayload,
    /// No handler is routed for the event type.
    Unroutable,
    /// The handler rejected the event ([`HandlerError::reject`](crate::HandlerError::reject)).
    Rejected,
    /// The last allowed delivery (the consumer's `max_deliver`) failed.
    MaxDeliveries,
}

impl Reason {
    /// The stable code stored in `inbox_dead_letters.reason`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::NotJson => "not_json",
            Self::NotCloudEvent => "not_cloudevent",
            Self::InvalidId => "invalid_id",
            Self::UndecodablePayload => "undecodable_payload",
            Self::Unroutable => "unroutable",
            Self::Rejected => "rejected",
            Self::MaxDeliveries => "max_deliveries",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A message that can never be handled, and why.
#[derive(Debug)]
pub struct Poison {
    reason: Reason,
    error: Error,
    event_id: Option<EventId>,
}

impl Poison {
    pub(crate) fn new(reason: Reason, error: Error) -> Self {
        Self {
            reason,
            error,
            event_id: None,
        }
    }

    pub(crate) fn with_event_id(mut self, id: EventId) -> Self {
        self.event_id = Some(id);
        self
    }

    /// Why.
    pub fn reason(&self) -> Reason {
        self.reason
    }

    /// The decode error.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The envelope id, when the body had a readable one.
    pub fn event_id(&self) -> Option<EventId> {
        self.event_id
    }
}

impl fmt::Display for Poison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.error)
    }
}

impl std::error::Error for Poison {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// Everything recorded about one dead letter.
#[derive(Debug)]
pub(crate) struct DeadLetter<'a> {
    pub(crate) info: &'a DeliveryInfo,
    pub(crate) event_id: Option<EventId>,
    pub(crate) reason: Reason,
    pub(crate) error: String,
    pub(crate) headers: Option<&'a HeaderMap>,
    pub(crate) payload: &'a [u8],
}

impl DeadLetter<'_> {
    /// Inserts the row; returns its id.
    pub(crate) async fn insert(&self, pool: &PgPool) -> Result<i64, Error> {
        let stream_sequence = i64::try_from(self.info.stream_sequence).unwrap_or(i64::MAX);
        let delivered = i64::try_from(self.info.delivered).unwrap_or(i64::MAX);
        sqlx::query_scalar::<_, i64>(INSERT_DEAD_LETTER)
            .bind(&self.info.consumer)
            .bind(&self.info.stream)
            .bind(stream_sequence)
            .bind(&self.info.nats_subject)
            .bind(self.event_id.map(uuid::Uuid::from))
            .bind(delivered)
            .bind(self.reason.as_str())
            .bind(&self.error)
            .bind(headers_json(self.headers))
            .bind(self.payload)
            .fetch_one(pool)
            .await
            .map_err(|e| Error::database("inserting into inbox_dead_letters", e))
    }

    /// Republishes the raw message to `subject` and waits for the stream's ack.
    pub(crate) async fn publish(
        &self,
        js: &jetstream::Context,
        subject: &str,
        timeout: Duration,
    ) -> Result<(), Error> {
        let mut headers = self.headers.cloned().unwrap_or_default();
        headers.insert(REASON_HEADER, self.reason.as_str());
        headers.insert("Inbox-Consumer", self.info.consumer.as_str());
        headers.insert("Inbox-Stream", self.info.stream.as_str());
        headers.insert(
            "Inbox-Stream-Sequence",
            self.info.stream_sequence.to_string().as_str(),
        );
        // The original id would be deduplicated away by a DLQ stream that saw it.
        headers.insert(
            "Nats-Msg-Id",
            format!(
                "{}:{}:{}",
                self.info.stream, self.info.stream_sequence, self.info.delivered
            )
            .as_str(),
        );
        let publish = async {
            js.publish_with_headers(
                subject.to_owned(),
                headers,
                bytes::Bytes::copy_from_slice(self.payload),
            )
            .await
            .map_err(|e| Error::nats("publishing a dead letter", e))?
            .await
            .map_err(|e| Error::nats("awaiting the dead letter's publish ack", e))
        };
        match tokio::time::timeout(timeout, publish).await {
            Ok(result) => result.map(drop),
            Err(elapsed) => Err(Error::new(
                ErrorKind::Nats,
                format!("publishing a dead letter to `{subject}` timed out"),
            )
            .with_source(elapsed)),
        }
    }
}

/// Message headers as `{"name": ["value", …]}`.
fn headers_json(headers: Option<&HeaderMap>) -> Value {
    let mut map = Map::new();
    if let Some(headers) = headers {
        for (name, values) in headers.iter() {
            let values = values
                .iter()
                .map(|v| Value::String(v.as_str().to_owned()))
                .collect();
            map.insert(name.to_string(), Value::Array(values));
        }
    }
    Value::Object(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_become_a_json_object_of_lists() {
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", "abc");
        h.append("x", "1");
        h.append("x", "2");
        let v = headers_json(Some(&h));
        assert_eq!(v["Nats-Msg-Id"], serde_json::json!(["abc"]));
        assert_eq!(v["x"], serde_json::json!(["1", "2"]));
        assert_eq!(headers_json(None), serde_json::json!({}));
    }

    #[test]
    fn reasons_have_stable_codes() {
        assert_eq!(Reason::MaxDeliveries.as_str(), "max_deliveries");
        assert_eq!(
            Reason::UndecodablePayload.to_string(),
            "undecodable_payload"
        );
    }
}
