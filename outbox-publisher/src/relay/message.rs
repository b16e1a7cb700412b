//! A claimed row becomes a message only after everything it carries is
//! checked: a row that fails is parked with an error naming the fault, and
//! nothing a writer can put in a column can stop or crash the relay.
//!
//! Whatever the length of a column, nothing but bounded values reaches
//! NATS: the subject is the event type (at most
//! [`MAX_EVENT_TYPE_LEN`](outbox_pg::MAX_EVENT_TYPE_LEN) bytes), and the
//! headers are the id, the stream name and a validated trace context
//! (`tracestate` at most 512 bytes). So the control line of every publish fits
//! nats-server's `max_control_line` (4 KiB by default), and no row can make
//! the server close the connection (which would look like a broker fault and
//! be retried forever); a longer `type`, `source` or `subject` is refused here
//! as invalid, and parked. `data` is sent as the database renders it
//! (`data::text`, verbatim), the size `Outbox::enqueue` measures.

use std::borrow::Cow;

use outbox_pg::{Envelope, EventId};
use serde_json::value::RawValue;

use crate::sink::{FailureKind, OutgoingMessage, PublishFailure};
use crate::store::ClaimedRow;

/// Room kept for the headers the relay sends with every message
/// (`Nats-Msg-Id`, `Nats-Expected-Stream`, and the NATS header framing).
const HEADER_OVERHEAD: usize = 256;

/// Longest column value quoted whole in a log line, in characters.
const LOG_VALUE_LEN: usize = 128;

/// A column value for a log line: as it is when short, else its first
/// [`LOG_VALUE_LEN`] characters and its length in bytes. Control characters
/// are escaped either way. A row written by any SQL client may hold a subject
/// of any length; the log line about it stays one short line.
pub(crate) fn for_log(value: &str) -> Cow<'_, str> {
    let plain = value.len() <= LOG_VALUE_LEN && !value.chars().any(char::is_control);
    if plain {
        return Cow::Borrowed(value);
    }
    let mut out: String = value.escape_debug().take(LOG_VALUE_LEN).collect();
    if value.escape_debug().nth(LOG_VALUE_LEN).is_some() {
        out.push_str(&format!("… ({} bytes)", value.len()));
    }
    Cow::Owned(out)
}

fn invalid(message: impl Into<String>) -> PublishFailure {
    PublishFailure::new(FailureKind::Invalid, message)
}

fn too_large(message: impl Into<String>) -> PublishFailure {
    PublishFailure::new(FailureKind::TooLarge, message)
}

/// The message for a row: the CloudEvents JSON envelope, with the row's `seq`
/// as the `sequence` extension (a scheduled row: its due time as
/// `scheduledfor`), on subject `event_type`. `max_payload` is the
/// broker's limit for one message (payload and headers).
pub(crate) fn to_message(
    row: &ClaimedRow,
    max_payload: usize,
) -> Result<OutgoingMessage, PublishFailure> {
    if let Some(e) = &row.decode_error {
        return Err(invalid(format!("row cannot be decoded: {e}")));
    }
    let core = |e: outbox_pg::Error| invalid(e.to_string());
    outbox_pg::validate_event_type(&row.event_type).map_err(core)?;
    let Some(time) = row.time else {
        return Err(invalid(
            "time is infinite or outside years 1-9999, which a CloudEvents (RFC 3339) time cannot carry",
        ));
    };
    outbox_pg::validate_time(time).map_err(core)?;
    if let Some(tp) = &row.traceparent {
        outbox_pg::validate_traceparent(tp).map_err(core)?;
    }
    if let Some(ts) = &row.tracestate {
        outbox_pg::validate_tracestate(ts).map_err(core)?;
    }
    let Some(data) = &row.data else {
        return Err(too_large(format!(
            "data is {} bytes: the message payload would exceed the broker's max payload of {max_payload} bytes",
            row.data_len
        )));
    };
    outbox_pg::check_json_decodable(data).map_err(core)?;
    let raw: &RawValue =
        serde_json::from_str(data).map_err(|e| invalid(format!("data is not JSON: {e}")))?;
    let seq =
        u64::try_from(row.seq).map_err(|_| invalid(format!("seq {} is negative", row.seq)))?;
    let id = EventId::from_uuid(row.id);
    let envelope = Envelope::from_parts(
        id,
        row.event_type.as_str(),
        row.source.as_str(),
        row.subject.as_str(),
        time,
        raw,
    )
    .map_err(core)?;
    // A scheduled row belongs to no entity order (see outbox_pg::Due): its
    // due time travels in place of the sequence.
    let envelope = match row.due_at {
        Some(due) => envelope.with_scheduled_for(due),
        None => envelope.with_sequence(seq),
    };
    let envelope = match &row.traceparent {
        Some(tp) => envelope.with_trace_context(tp.clone(), row.tracestate.clone()),
        None => envelope,
    };
    let payload = envelope.to_json().map_err(core)?;
    let headers = row.traceparent.as_ref().map_or(0, |t| t.len() + 16)
        + row.tracestate.as_ref().map_or(0, |t| t.len() + 16)
        + HEADER_OVERHEAD;
    if payload.len() + headers > max_payload {
        return Err(too_large(format!(
            "message payload would be {} bytes with headers, over the broker's max payload of {max_payload} bytes",
            payload.len() + headers
        )));
    }
    Ok(OutgoingMessage {
        id,
        subject: row.event_type.clone(),
        payload: payload.into(),
        traceparent: row.traceparent.clone(),
        tracestate: row.tracestate.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> ClaimedRow {
        ClaimedRow::sample()
    }

    fn error_of(row: &ClaimedRow) -> PublishFailure {
        match to_message(row, 1 << 20) {
            Ok(_) => panic!("expected a failure"),
            Err(e) => e,
        }
    }

    #[test]
    fn a_valid_row_carries_its_sequence_and_data_verbatim() {
        let message = to_message(&row(), 1 << 20).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(json["sequence"], "00000000000000000042");
        assert_eq!(json["data"]["n"], 1);
        assert_eq!(message.subject, "a.b");
    }

    #[test]
    fn a_scheduled_row_carries_its_due_time_and_no_sequence() {
        let due = chrono::DateTime::parse_from_rfc3339("2026-12-20T08:00:00.5Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        let scheduled = ClaimedRow {
            due_at: Some(due),
            ..row()
        };
        let message = to_message(&scheduled, 1 << 20).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        assert!(json.get("sequence").is_none(), "{json}");
        assert_eq!(json["scheduledfor"], "2026-12-20T08:00:00.500Z");
        let back = outbox_pg::Envelope::<serde_json::Value>::from_json(&message.payload).unwrap();
        assert_eq!(back.scheduled_for(), Some(due));
        assert_eq!(back.sequence(), None);
    }

    #[test]
    fn every_unpublishable_column_is_a_permanent_named_failure() {
        type Mutation = Box<dyn Fn(&mut ClaimedRow)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (
                Box::new(|r| r.traceparent = Some("00-ab\n".into())),
                "traceparent",
            ),
            (
                Box::new(|r| {
                    r.traceparent =
                        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
                    r.tracestate = Some("a=b\r\nc=d".into());
                }),
                "tracestate",
            ),
            (Box::new(|r| r.time = None), "time"),
            (Box::new(|r| r.data = Some(r#"{"n":1e400}"#.into())), "data"),
            (
                Box::new(|r| r.event_type = "$JS.API.STREAM.DELETE.X".into()),
                "type",
            ),
            (Box::new(|r| r.event_type = "_INBOX.x".into()), "type"),
            (Box::new(|r| r.event_type = "has space".into()), "type"),
            (Box::new(|r| r.subject = String::new()), "subject"),
            (Box::new(|r| r.source = String::new()), "source"),
            (
                Box::new(|r| {
                    r.data = None;
                    r.data_len = 2_000_000;
                }),
                "payload",
            ),
            (Box::new(|r| r.decode_error = Some("bad".into())), "decoded"),
        ];
        for (mutate, word) in cases {
            let mut r = row();
            mutate(&mut r);
            let e = error_of(&r);
            assert!(e.kind().is_permanent(), "{e}");
            assert!(e.to_string().to_lowercase().contains(word), "{word}: {e}");
        }
    }

    #[test]
    fn log_values_are_short_and_escaped() {
        assert_eq!(for_log("order-1"), "order-1");
        assert_eq!(for_log("a\nb"), "a\\nb");
        let long = "x".repeat(100_000);
        let shown = for_log(&long);
        assert!(shown.len() < 200, "{shown}");
        assert!(shown.ends_with("… (100000 bytes)"), "{shown}");
    }

    #[test]
    fn a_message_over_the_max_payload_is_too_large() {
        let mut r = row();
        r.data = Some(format!("\"{}\"", "x".repeat(2_000)));
        let e = to_message(&r, 1_000).err().unwrap();
        assert_eq!(e.kind(), FailureKind::TooLarge);
        assert!(e.to_string().contains("payload"));
    }
}
