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
        headers.insert("Inbox-Consumer", self.info.consumer.as_str());
        headers.insert("Inbox-Stream", self.info.stream.as_str());
        headers.insert(
            "Inbox-Stream-Sequence",
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
