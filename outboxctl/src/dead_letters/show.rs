//! `outboxctl dead-letters show <id>`.
//!
//! `--json`: every column of the row, with the headers as stored
//! (`{"name": ["value", …]}`) and the payload as
//! `{"encoding": "json" | "text" | "base64", "bytes": N, "value": …}`: the
//! parsed document when the bytes are JSON, the string when they are UTF-8
//! text, else their standard base64. `raw_headers`: the header block as
//! the stream stored it, in the same form, for a message no client could
//! read (reason `undecodable_headers`; else null).

use std::io::Write;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;

use super::{Row, fetch};
use crate::db::Database;
use crate::error::Result;
use crate::output::when;
use crate::output::{self, Report};

/// Flags of `outboxctl dead-letters show`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The dead letter's id (the `id` column, as `list` shows it).
    id: i64,
}

#[derive(Debug, Serialize)]
struct Show {
    id: i64,
    consumer: String,
    stream: String,
    stream_sequence: i64,
    subject: String,
    event_id: Option<uuid::Uuid>,
    delivery_count: i64,
    reason: String,
    error: String,
    created_at: DateTime<Utc>,
    replay_count: i32,
    replayed_at: Option<DateTime<Utc>>,
    headers: Value,
    payload: Payload,
    raw_headers: Option<Payload>,
}

/// The payload in the most readable form its bytes allow.
#[derive(Debug, Serialize, PartialEq)]
pub(crate) struct Payload {
    encoding: &'static str,
    bytes: usize,
    value: Value,
}

impl Payload {
    pub(crate) fn of(bytes: &[u8]) -> Self {
        let (encoding, value) = match serde_json::from_slice::<Value>(bytes) {
            Ok(value) => ("json", value),
            Err(_) => match std::str::from_utf8(bytes) {
                Ok(text) => ("text", Value::String(text.to_owned())),
                Err(_) => ("base64", Value::String(base64(bytes))),
            },
        };
        Self {
            encoding,
            bytes: bytes.len(),
            value,
        }
    }
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let pool = db.connect(&["inbox_dead_letters"]).await?;
    let mut rows = fetch(&pool, &[args.id]).await?;
    let Some(row) = rows.pop() else {
        // fetch names every id it did not find.
        return Ok(());
    };
    output::print(&Show::from(row), json)
}

impl From<Row> for Show {
    fn from(r: Row) -> Self {
        let raw = r.raw_headers.clone();
        Self {
            payload: Payload::of(&r.payload),
            id: r.id,
            consumer: r.consumer,
            stream: r.stream,
            stream_sequence: r.stream_sequence,
            subject: r.subject,
            event_id: r.event_id,
            delivery_count: r.delivery_count,
            reason: r.reason,
            error: r.error,
            created_at: r.created_at,
            replay_count: r.replay_count,
            replayed_at: r.replayed_at,
            headers: r.headers,
            raw_headers: raw.as_deref().map(Payload::of),
        }
    }
}

impl Report for Show {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let rows: Vec<Vec<String>> = [
            ("id", self.id.to_string()),
            ("consumer", self.consumer.clone()),
            ("stream", self.stream.clone()),
            ("stream sequence", self.stream_sequence.to_string()),
            ("subject", self.subject.clone()),
            (
                "event id",
                self.event_id
                    .map_or_else(|| "-".to_owned(), |id| id.to_string()),
            ),
            ("deliveries", self.delivery_count.to_string()),
            ("reason", self.reason.clone()),
            ("created", when(Some(self.created_at))),
            ("replays", self.replay_count.to_string()),
            ("last replayed", when(self.replayed_at)),
        ]
        .into_iter()
        .map(|(k, v)| vec![format!("{k}:"), v])
        .collect();
        output::table(out, &rows)?;
        writeln!(out, "error:")?;
        for line in self.error.lines() {
            writeln!(out, "  {line}")?;
        }
        writeln!(out, "headers:")?;
        if let Value::Object(headers) = &self.headers {
            for (name, values) in headers {
                match values {
                    Value::Array(values) => {
                        for v in values {
                            writeln!(out, "  {name}: {}", v.as_str().unwrap_or_default())?;
                        }
                    }
                    other => writeln!(out, "  {name}: {other}")?,
                }
            }
        }
        if let Some(raw) = &self.raw_headers {
            writeln!(
                out,
                "raw header block (as stored; no client can read it; {} bytes, escaped):",
                raw.bytes
            )?;
            for line in escaped_lines(raw) {
                writeln!(out, "  {line}")?;
            }
        }
        writeln!(
            out,
            "payload ({}, {} bytes):",
            self.payload.encoding, self.payload.bytes
        )?;
        let text = match &self.payload.value {
            Value::String(s) => s.clone(),
            value => serde_json::to_string_pretty(value).unwrap_or_default(),
        };
        writeln!(out, "{text}")
    }
}

/// A header block shown line by line (split at CRLF only, so a bare CR or
/// LF shows where it stands), each byte that is not printable ASCII escaped
/// (`\n`, `\xff`); `raw` holds it as [`Payload::of`] put it.
fn escaped_lines(raw: &Payload) -> Vec<String> {
    use base64::Engine as _;
    let bytes = match (&raw.value, raw.encoding) {
        (Value::String(s), "base64") => base64::engine::general_purpose::STANDARD
            .decode(s)
            .unwrap_or_default(),
        (Value::String(s), _) => s.clone().into_bytes(),
        (other, _) => other.to_string().into_bytes(),
    };
    let mut lines = Vec::new();
    let mut rest = bytes.as_slice();
    while !rest.is_empty() {
        let end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .unwrap_or(rest.len());
        let (line, after) = rest.split_at(end);
        if !line.is_empty() {
            lines.push(line.escape_ascii().to_string());
        }
        rest = after.get(2..).unwrap_or_default();
    }
    lines
}

/// Standard base64 (RFC 4648, padded).
fn base64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_the_standard_padded_one() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foob"), "Zm9vYg==");
        assert_eq!(base64(&[0xff, 0xfe, 0x00]), "//4A");
    }

    #[test]
    fn payloads_read_as_json_then_text_then_base64() {
        let json = Payload::of(br#"{"id":"x"}"#);
        assert_eq!(json.encoding, "json");
        assert_eq!(json.value, serde_json::json!({"id": "x"}));
        let text = Payload::of(b"not json");
        assert_eq!(text.encoding, "text");
        assert_eq!(text.value, Value::String("not json".into()));
        let binary = Payload::of(&[0xff, 0xfe, 0x00]);
        assert_eq!(
            escaped_lines(&Payload::of(
                b"NATS/1.0\r\nX-Note: a\nb\r\nX-\xffN: v\r\n\r\n"
            )),
            ["NATS/1.0", "X-Note: a\\nb", "X-\\xffN: v"]
        );
        assert_eq!(binary.encoding, "base64");
        assert_eq!(binary.value, Value::String("//4A".into()));
        assert_eq!(binary.bytes, 3);
    }
}
