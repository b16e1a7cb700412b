//! Dead letters: messages that will never be handled, kept with their raw
//! bytes, headers and the reason, then terminated (`AckKind::Term`).
//!
//! A dead letter is written to `inbox_dead_letters` (migration
//! `20260101000003_inbox_dead_letters.sql`) and, when a DLQ subject is
//! configured, also published there with its original headers plus
//! `Inbox-Dead-Letter-Reason`, `Inbox-Consumer`, `Inbox-Stream` and
//! `Inbox-Stream-Sequence`. Only once both succeeded is the message
//! terminated; if either fails the message is nak'ed and dead-lettering is
//! tried again on redelivery, so poison is never dropped silently.
//!
//! A message is dead-lettered once per consumer, even when the `Term` after
//! its dead letter is lost and JetStream redelivers it: the insert finds the
//! row written before (same consumer, stream, stream sequence and bytes;
//! migration `20260101000007_inbox_dead_letters_by_message.sql`) and returns
//! it, and the DLQ copy carries `Nats-Msg-Id` `consumer:stream:sequence`, so
//! a DLQ stream's duplicate window drops the second publish.
//!
//! # Replay
//!
//! `outboxctl dead-letters replay` publishes a dead letter's payload again to
//! its stream, with its original headers (less `Nats-Msg-Id` and the headers
//! added here), a fresh `Nats-Msg-Id` and [`REPLAY_CONSUMER_HEADER`] naming
//! the consumer it is for. Every consumer of the stream receives it, but only
//! that one handles it: the runtime acks a replay naming another consumer
//! without handling it (counted as `inbox_replays_ignored_total`). The event
//! keeps its own id, so the named consumer's inbox still dedupes it.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use outbox_pg::EventId;
use serde_json::{Map, Value};
use sqlx::PgPool;

use crate::delivery::DeliveryInfo;
use crate::error::{Error, ErrorKind};

pub use crate::poison::{Poison, Reason};

/// Header naming the [`Reason`] on a message republished to the DLQ subject.
pub const REASON_HEADER: &str = "Inbox-Dead-Letter-Reason";
/// Header naming the consumer on a message republished to the DLQ subject.
pub const CONSUMER_HEADER: &str = "Inbox-Consumer";
/// Header naming the stream on a message republished to the DLQ subject.
pub const STREAM_HEADER: &str = "Inbox-Stream";
/// Header naming the stream sequence on a message republished to the DLQ subject.
pub const STREAM_SEQUENCE_HEADER: &str = "Inbox-Stream-Sequence";
/// Every header the DLQ copy adds to the original ones (a replay drops them).
pub const DEAD_LETTER_HEADERS: [&str; 4] = [
    REASON_HEADER,
    CONSUMER_HEADER,
    STREAM_HEADER,
    STREAM_SEQUENCE_HEADER,
];
/// Header of a replayed dead letter naming the one consumer (durable name, the
/// inbox's `consumer`) that is to handle it; every other consumer of the
/// stream acks it without handling it. See [Replay](self#replay).
pub const REPLAY_CONSUMER_HEADER: &str = "Inbox-Replay-Consumer";

/// The consumer a replayed message is for: the value of
/// [`REPLAY_CONSUMER_HEADER`], or `None` for a message that is not a replay.
pub fn replay_consumer(headers: Option<&HeaderMap>) -> Option<&str> {
    headers?
        .get(REPLAY_CONSUMER_HEADER)
        .map(async_nats::HeaderValue::as_str)
}

/// Whether a message with `headers` is a replay meant for a consumer other
/// than `consumer` (which then acks it without handling it); returns the
/// consumer it is for.
pub(crate) fn replay_for_another<'h>(
    headers: Option<&'h HeaderMap>,
    consumer: &str,
) -> Option<&'h str> {
    replay_consumer(headers).filter(|target| *target != consumer)
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
    /// The header block as stored, when no client could read it.
    pub(crate) raw_headers: Option<&'a [u8]>,
}

impl DeadLetter<'_> {
    /// Inserts the row, unless this consumer already dead-lettered the same
    /// message; returns the row's id.
    pub(crate) async fn insert(&self, pool: &PgPool) -> Result<i64, Error> {
        let stream_sequence = i64::try_from(self.info.stream_sequence).unwrap_or(i64::MAX);
        let delivered = i64::try_from(self.info.delivered).unwrap_or(i64::MAX);
        sqlx::query_file_scalar!(
            "queries/insert_dead_letter.sql",
            &self.info.consumer,
            &self.info.stream,
            stream_sequence,
            &self.info.nats_subject,
            self.event_id.map(uuid::Uuid::from),
            delivered,
            self.reason.as_str(),
            &self.error,
            headers_json(self.headers),
            self.payload,
            self.raw_headers,
        )
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
        headers.insert(CONSUMER_HEADER, self.info.consumer.as_str());
        headers.insert(STREAM_HEADER, self.info.stream.as_str());
        headers.insert(
            STREAM_SEQUENCE_HEADER,
            self.info.stream_sequence.to_string().as_str(),
        );
        // The original id would be deduplicated away by a DLQ stream that saw
        // it; this one names the message for this consumer, so a second
        // dead-lettering of it (its Term lost) is deduplicated instead.
        headers.insert(
            "Nats-Msg-Id",
            format!(
                "{}:{}:{}",
                self.info.consumer, self.info.stream, self.info.stream_sequence
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
            .map_err(|e| Error::caused(ErrorKind::Nats, "publishing a dead letter", e))?
            .await
            .map_err(|e| {
                Error::caused(ErrorKind::Nats, "awaiting the dead letter's publish ack", e)
            })
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
    fn a_replay_for_another_consumer_is_told_apart() {
        let mut h = HeaderMap::new();
        assert_eq!(replay_consumer(None), None);
        assert_eq!(replay_consumer(Some(&h)), None);
        assert_eq!(replay_for_another(Some(&h), "billing"), None);
        h.insert(REPLAY_CONSUMER_HEADER, "billing");
        assert_eq!(replay_consumer(Some(&h)), Some("billing"));
        assert_eq!(replay_for_another(Some(&h), "billing"), None);
        assert_eq!(replay_for_another(Some(&h), "mailer"), Some("billing"));
    }

    #[test]
    fn reasons_have_stable_codes() {
        assert_eq!(Reason::MaxDeliveries.as_str(), "max_deliveries");
        assert_eq!(Reason::Panic.as_str(), "panic");
        assert_eq!(
            Reason::UndecodablePayload.to_string(),
            "undecodable_payload"
        );
    }
}
