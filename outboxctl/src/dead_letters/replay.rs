//! `outboxctl dead-letters replay <id>…`: each dead letter published again
//! to its stream, for its consumer only.
//!
//! Every id is looked up, and every row's headers checked, before anything is
//! published: an unknown id is [`ErrorKind::NotFound`] naming it, and nothing
//! is sent. Then, per dead letter, in the order given:
//!
//! 1. publish the stored payload to the stored subject with the stored
//!    headers, less `Nats-Msg-Id`, `Nats-Expected-*` and the headers the DLQ
//!    copy adds ([`DEAD_LETTER_HEADERS`]), plus
//!    `Nats-Msg-Id: replay:<consumer>:<id>:<replay_count + 1>` (a new id per
//!    replay, so the stream's duplicate window does not drop it, and a
//!    replay done again on purpose gets through) and
//!    [`REPLAY_CONSUMER_HEADER`]` : <consumer>`;
//! 2. await the PubAck (`--timeout`), and check that the stream that stored
//!    it is the dead letter's stream;
//! 3. `replay_count + 1, replayed_at = now()` on the row.
//!
//! No transaction or row lock is held while publishing. A PubAck marked
//! duplicate (a replay whose row update was lost, run again) is counted too:
//! the message of that id is in the stream.
//!
//! `--json`:
//!
//! ```text
//! {"replayed": [{"id": 7, "consumer": "billing", "stream": "OUTBOX", "subject": "invoice.raised",
//!                "event_id": "…" | null, "msg_id": "replay:billing:7:1",
//!                "stream_sequence": 43, "duplicate": false,
//!                "replay_count": 1, "replayed_at": "…"}]}
//! ```
//!
//! [`DEAD_LETTER_HEADERS`]: inbox_consumer::dead_letter::DEAD_LETTER_HEADERS
//! [`REPLAY_CONSUMER_HEADER`]: inbox_consumer::dead_letter::REPLAY_CONSUMER_HEADER

use std::io::Write;
use std::str::FromStr;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use chrono::{DateTime, Utc};
use inbox_consumer::dead_letter::{DEAD_LETTER_HEADERS, REPLAY_CONSUMER_HEADER};
use outbox_pg::connect::NatsArgs;
use serde::Serialize;
use serde_json::Value;

use super::{Row, fetch};
use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::when;
use crate::output::{self, Report};
use crate::time::parse_duration;

/// Flags of `outboxctl dead-letters replay`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The dead letters' ids (the `id` column, as `list` shows it).
    #[arg(required = true, value_name = "ID")]
    ids: Vec<i64>,

    #[command(flatten)]
    nats: NatsArgs,

    /// How long to wait for NATS: the connection, and each PubAck.
    #[arg(long, value_name = "D", default_value = "10s", value_parser = parse_duration)]
    timeout: Duration,
}

#[derive(Debug, Serialize)]
struct Replays {
    replayed: Vec<Replayed>,
}

#[derive(Debug, Serialize)]
struct Replayed {
    id: i64,
    consumer: String,
    stream: String,
    subject: String,
    event_id: Option<uuid::Uuid>,
    msg_id: String,
    stream_sequence: u64,
    duplicate: bool,
    replay_count: i32,
    replayed_at: DateTime<Utc>,
}

/// One dead letter ready to go: its message id and headers.
struct Prepared {
    row: Row,
    msg_id: String,
    headers: HeaderMap,
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let pool = db.connect(&["inbox_dead_letters"]).await?;
    let prepared: Vec<Prepared> = fetch(&pool, &args.ids)
        .await?
        .into_iter()
        .map(prepare)
        .collect::<Result<_>>()?;
    let js = crate::nats::jetstream(&args.nats, args.timeout).await?;
    let mut report = Replays {
        replayed: Vec::with_capacity(prepared.len()),
    };
    for p in prepared {
        let done: Vec<String> = report.replayed.iter().map(|r| r.id.to_string()).collect();
        let id = p.row.id;
        let replaying = replay(&pool, &js, p, args.timeout);
        let replayed = crate::nats::unless_denied(&args.nats, replaying)
            .await
            .map_err(|e| {
                if done.is_empty() {
                    e
                } else {
                    Error::new(
                        e.kind(),
                        format!("{e} (replayed before it: {})", done.join(", ")),
                    )
                }
            })?;
        debug_assert_eq!(replayed.id, id);
        report.replayed.push(replayed);
    }
    output::print(&report, json)
}

/// The message id and headers of `row`'s replay.
///
/// # Errors
/// [`ErrorKind::InvalidState`] if the stored headers are not
/// `{"name": ["value", …]}` of valid NATS header names and values.
fn prepare(row: Row) -> Result<Prepared> {
    let msg_id = format!(
        "replay:{}:{}:{}",
        row.consumer,
        row.id,
        row.replay_count.saturating_add(1)
    );
    let invalid = |what: String| {
        Error::new(
            ErrorKind::InvalidState,
            format!("dead letter {}: {what}; not replayed", row.id),
        )
    };
    let mut headers = HeaderMap::new();
    let Value::Object(stored) = &row.headers else {
        return Err(invalid(format!(
            "its headers are not an object of lists but {}",
            row.headers
        )));
    };
    for (name, values) in stored {
        if dropped(name) {
            continue;
        }
        let header = HeaderName::from_str(name)
            .map_err(|e| invalid(format!("header name {name:?} is not valid in NATS ({e})")))?;
        let Value::Array(values) = values else {
            return Err(invalid(format!(
                "header {name:?} holds {values}, not a list"
            )));
        };
        for value in values {
            let text = value
                .as_str()
                .ok_or_else(|| invalid(format!("header {name:?} holds {value}, not a string")))?;
            let value = HeaderValue::from_str(text).map_err(|e| {
                invalid(format!(
                    "header {name:?} value {text:?} is not valid in NATS ({e})"
                ))
            })?;
            headers.append(header.clone(), value);
        }
    }
    let for_consumer = HeaderValue::from_str(&row.consumer).map_err(|e| {
        invalid(format!(
            "its consumer {:?} cannot be a header value ({e})",
            row.consumer
        ))
    })?;
    let id_value = HeaderValue::from_str(&msg_id)
        .map_err(|e| invalid(format!("message id {msg_id:?} is not valid in NATS ({e})")))?;
    headers.insert(REPLAY_CONSUMER_HEADER, for_consumer);
    headers.insert("Nats-Msg-Id", id_value);
    Ok(Prepared {
        row,
        msg_id,
        headers,
    })
}

/// Whether a stored header stays out of the replay: the old message id, the
/// stream expectations of the first publish, the DLQ copy's headers and an
/// earlier replay's target.
fn dropped(name: &str) -> bool {
    let is = |other: &str| name.eq_ignore_ascii_case(other);
    is("Nats-Msg-Id")
        || is(REPLAY_CONSUMER_HEADER)
        || DEAD_LETTER_HEADERS.iter().any(|h| is(h))
        || name
            .get(..14)
            .is_some_and(|p| p.eq_ignore_ascii_case("Nats-Expected-"))
}

/// Publishes one prepared dead letter, awaits its PubAck, checks its stream,
/// then counts the replay on the row.
async fn replay(
    pool: &sqlx::PgPool,
    js: &jetstream::Context,
    p: Prepared,
    timeout: Duration,
) -> Result<Replayed> {
    let Prepared {
        row,
        msg_id,
        headers,
    } = p;
    let id = row.id;
    let failed = |what: String| {
        Error::new(
            ErrorKind::Nats,
            format!(
                "dead letter {id}: publishing to `{}`: {what}; not marked replayed",
                row.subject
            ),
        )
    };
    let publish = async {
        js.publish_with_headers(row.subject.clone(), headers, row.payload.clone().into())
            .await
            .map_err(|e| failed(e.to_string()))?
            .await
            .map_err(|e| failed(format!("no PubAck: {e}")))
    };
    let ack = tokio::time::timeout(timeout, publish).await.map_err(|_| {
        failed(format!(
            "no PubAck in {}",
            humantime::format_duration(timeout)
        ))
    })??;
    if ack.stream != row.stream {
        return Err(Error::new(
            ErrorKind::InvalidState,
            format!(
                "dead letter {id}: subject `{}` was stored by stream `{}` (sequence {}), not by \
                 `{}` where it was dead-lettered; the consumer `{}` reads `{}`; not marked \
                 replayed",
                row.subject, ack.stream, ack.sequence, row.stream, row.consumer, row.stream
            ),
        ));
    }
    let marked = sqlx::query_file!("queries/dead_letter_replayed.sql", id)
        .fetch_optional(pool)
        .await
        .map_err(|e| {
            Error::database(
                &format!(
                    "dead letter {id}: published (stream sequence {}) but counting the replay",
                    ack.sequence
                ),
                e,
            )
        })?
        .ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!(
                    "dead letter {id}: published (stream sequence {}), but the row is gone \
                     (purged meanwhile)",
                    ack.sequence
                ),
            )
        })?;
    Ok(Replayed {
        id,
        consumer: row.consumer,
        stream: row.stream,
        subject: row.subject,
        event_id: row.event_id,
        msg_id,
        stream_sequence: ack.sequence,
        duplicate: ack.duplicate,
        replay_count: marked.replay_count,
        replayed_at: marked.replayed_at,
    })
}

impl Report for Replays {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let mut rows = vec![
            [
                "id",
                "consumer",
                "subject",
                "event id",
                "stream sequence",
                "replays",
                "at",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for r in &self.replayed {
            rows.push(vec![
                r.id.to_string(),
                r.consumer.clone(),
                r.subject.clone(),
                r.event_id
                    .map_or_else(|| "-".to_owned(), |id| id.to_string()),
                format!(
                    "{}{}",
                    r.stream_sequence,
                    if r.duplicate { " (duplicate)" } else { "" }
                ),
                r.replay_count.to_string(),
                when(Some(r.replayed_at)),
            ]);
        }
        output::table(out, &rows)?;
        writeln!(
            out,
            "replayed {} dead letter{}",
            self.replayed.len(),
            if self.replayed.len() == 1 { "" } else { "s" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(headers: Value) -> Row {
        Row {
            id: 7,
            consumer: "billing".into(),
            stream: "OUTBOX".into(),
            stream_sequence: 3,
            subject: "invoice.raised".into(),
            event_id: None,
            delivery_count: 1,
            reason: "rejected".into(),
            error: "no".into(),
            headers,
            payload: b"{}".to_vec(),
            raw_headers: None,
            created_at: Utc::now(),
            replay_count: 1,
            replayed_at: None,
        }
    }

    #[test]
    fn a_replay_keeps_the_headers_but_its_own_id_and_names_its_consumer() {
        let p = prepare(row(serde_json::json!({
            "Nats-Msg-Id": ["0190…"],
            "Nats-Expected-Stream": ["OUTBOX"],
            "traceparent": ["00-abc-def-01"],
            "Inbox-Dead-Letter-Reason": ["rejected"],
            "Inbox-Consumer": ["billing"],
            "Inbox-Replay-Consumer": ["mailer"],
            "x": ["1", "2"],
        })))
        .unwrap();
        assert_eq!(p.msg_id, "replay:billing:7:2");
        let h = &p.headers;
        assert_eq!(h.get("Nats-Msg-Id").unwrap().as_str(), "replay:billing:7:2");
        assert_eq!(h.get(REPLAY_CONSUMER_HEADER).unwrap().as_str(), "billing");
        assert_eq!(h.get("traceparent").unwrap().as_str(), "00-abc-def-01");
        assert_eq!(h.get_all("x").count(), 2);
        assert!(h.get("Nats-Expected-Stream").is_none());
        assert!(h.get("Inbox-Dead-Letter-Reason").is_none());
        assert!(h.get("Inbox-Consumer").is_none());
    }

    #[test]
    fn headers_that_nats_cannot_carry_are_refused_before_publishing() {
        let e = prepare(row(serde_json::json!({"bad:name": ["v"]})))
            .err()
            .unwrap();
        assert_eq!(e.kind(), ErrorKind::InvalidState);
        assert!(e.to_string().contains("dead letter 7"), "{e}");
        let e = prepare(row(serde_json::json!({"x": ["a\r\nb"]})))
            .err()
            .unwrap();
        assert_eq!(e.kind(), ErrorKind::InvalidState);
        let e = prepare(row(serde_json::json!(["x"]))).err().unwrap();
        assert_eq!(e.kind(), ErrorKind::InvalidState);
    }
}
