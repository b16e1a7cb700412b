//! `outboxctl audit`: reads the messages of rows published within `--since`
//! back from their stream, by the sequence of their PubAck
//! (`published_seq`), and reports the rows whose message is gone or is
//! another message; `--republish` makes those rows unpublished again, in the
//! retry lane and due now, so the relay that owns their shard publishes them
//! again under the same id.
//!
//! The same logic as the relay's audit task
//! ([`outbox_publisher::audit::Audit`]): only the server's "no message found"
//! or a message with another `Nats-Msg-Id` (or subject) is a finding; any
//! error reading the stream fails the command and changes nothing more. With
//! `--republish`, rows published within the stream's duplicate window (plus
//! its margin) are left out: a republish that soon could be dropped as a
//! duplicate of the lost message. Rows the stream discards by its limits
//! (`max_age`, or below the first sequence of a stream with `max_msgs` /
//! `max_bytes`) are counted as `discarded`, not lost.
//!
//! `--json`:
//!
//! ```text
//! {"stream": "OUTBOX", "from": "…", "until": "…", "republish": false,
//!  "checked": 120, "intact": 117, "discarded": 0, "missing": 2, "mismatched": 1,
//!  "republished": 0,
//!  "lost": [{"id": "…", "event_type": "invoice.raised", "subject": "inv-7",
//!            "stream": "OUTBOX", "seq": 42, "published_at": "…",
//!            "finding": "missing" | "mismatched",
//!            "found_message_id": null, "found_subject": null}]}
//! ```

use std::io::Write;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_pg::connect::NatsArgs;
use outbox_publisher::audit::{Audit, Finding};
use serde::Serialize;

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::{self, Report};
use crate::time::{cutoff, parse_duration};

/// Flags of `outboxctl audit`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Audit rows published within this window (e.g. 1h, 30m, 2d).
    #[arg(long, value_name = "D", default_value = "1h", value_parser = parse_duration)]
    since: Duration,

    /// The stream the rows were published to.
    #[arg(long, env = "OUTBOX_STREAM", default_value = "OUTBOX")]
    stream: String,

    /// Make each lost row unpublished again, for the relay to publish again.
    /// Refused when `--since` reaches past `--inbox-window`: a consumer whose
    /// inbox row of such an event is pruned would apply it again.
    #[arg(long)]
    republish: bool,

    /// The shortest inbox retention window of the stream's consumers (the
    /// inbox's default is 14 days): `--republish` never reaches further back.
    #[arg(long, value_name = "D", default_value = "14d", value_parser = parse_duration)]
    inbox_window: Duration,

    /// Message reads in flight at once.
    #[arg(long, value_name = "N", default_value_t = 16)]
    concurrency: usize,

    #[command(flatten)]
    nats: NatsArgs,

    /// How long to wait for NATS: the connection, and each read.
    #[arg(long, value_name = "D", default_value = "10s", value_parser = parse_duration)]
    timeout: Duration,
}

#[derive(Debug, Serialize)]
struct Audited {
    stream: String,
    from: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    republish: bool,
    checked: u64,
    intact: u64,
    discarded: u64,
    missing: u64,
    mismatched: u64,
    republished: u64,
    lost: Vec<Lost>,
}

#[derive(Debug, Serialize)]
struct Lost {
    id: uuid::Uuid,
    event_type: String,
    subject: String,
    stream: String,
    seq: i64,
    published_at: DateTime<Utc>,
    finding: &'static str,
    found_message_id: Option<String>,
    found_subject: Option<String>,
}

impl Report for Audited {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let when = |t: Option<DateTime<Utc>>| {
            t.map_or_else(
                || "-".to_owned(),
                |t| t.format("%Y-%m-%d %H:%M:%S").to_string(),
            )
        };
        writeln!(
            out,
            "stream {}: rows published {} .. {} UTC",
            self.stream,
            when(self.from),
            when(self.until)
        )?;
        writeln!(
            out,
            "checked {}, intact {}, discarded by the stream's limits {}, missing {}, mismatched {}",
            self.checked, self.intact, self.discarded, self.missing, self.mismatched
        )?;
        if self.lost.is_empty() {
            return Ok(());
        }
        let mut rows = vec![vec![
            "ID".to_owned(),
            "EVENT TYPE".to_owned(),
            "SUBJECT".to_owned(),
            "SEQ".to_owned(),
            "PUBLISHED".to_owned(),
            "FOUND".to_owned(),
        ]];
        for l in &self.lost {
            rows.push(vec![
                l.id.to_string(),
                l.event_type.clone(),
                l.subject.clone(),
                l.seq.to_string(),
                l.published_at.format("%Y-%m-%d %H:%M:%S").to_string(),
                match (&l.found_message_id, &l.found_subject) {
                    (None, None) => l.finding.to_owned(),
                    (id, subject) => format!(
                        "{} (Nats-Msg-Id {}, subject {})",
                        l.finding,
                        id.as_deref().unwrap_or("none"),
                        subject.as_deref().unwrap_or("-")
                    ),
                },
            ]);
        }
        output::table(out, &rows)?;
        if self.republish {
            writeln!(
                out,
                "{} rows made unpublished again; the relay publishes them again",
                self.republished
            )
        } else {
            writeln!(
                out,
                "run again with --republish to have the relay publish them again"
            )
        }
    }
}

/// Refuses `--republish` reaching past the consumers' inbox window: an event
/// republished after its inbox rows were pruned is applied again.
fn check_window(args: &Args) -> Result<()> {
    if args.republish && args.since > args.inbox_window {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "--republish with --since {} reaches past the consumers' inbox window ({}): a \
                 consumer whose inbox no longer holds such an event would apply it again. Audit \
                 a shorter window, or give --inbox-window the shortest retention of the \
                 stream's consumers",
                humantime::format_duration(args.since),
                humantime::format_duration(args.inbox_window)
            ),
        ));
    }
    Ok(())
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    // Checked before connecting: a window out of the calendar is a flag error.
    cutoff(args.since, "--since")?;
    check_window(args)?;
    let pool = db.connect(&["outbox_events"]).await?;
    let js = crate::nats::jetstream(&args.nats, args.timeout).await?;
    let auditing = async {
        let audit = Audit::new(pool, js, &args.stream)
            .await
            .map_err(publisher_error)?
            .concurrency(args.concurrency)
            .read_timeout(args.timeout);
        if let Some(why) = audit.unauditable() {
            return Err(Error::new(
                ErrorKind::InvalidState,
                format!("cannot audit: {why}"),
            ));
        }
        // By the database's clock, which set published_at.
        let now = audit.now().await.map_err(publisher_error)?;
        let from = chrono::Duration::from_std(args.since)
            .ok()
            .and_then(|d| now.checked_sub_signed(d))
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    "--since reaches out of the calendar".to_owned(),
                )
            })?;
        audit
            .run(from, now, args.republish, 500)
            .await
            .map_err(publisher_error)
    };
    let report = crate::nats::unless_denied(&args.nats, auditing).await?;
    let out = Audited {
        stream: args.stream.clone(),
        from: report.from,
        until: report.until,
        republish: args.republish,
        checked: report.checked,
        intact: report.intact,
        discarded: report.discarded,
        missing: report.missing,
        mismatched: report.mismatched,
        republished: report.republished,
        lost: report
            .lost
            .into_iter()
            .map(|c| {
                let (finding, found_message_id, found_subject) = match c.finding {
                    Finding::Mismatched {
                        message_id,
                        subject,
                    } => ("mismatched", message_id, Some(subject)),
                    _ => ("missing", None, None),
                };
                Lost {
                    id: c.row.id,
                    event_type: c.row.event_type,
                    subject: c.row.subject,
                    stream: c.row.stream,
                    seq: c.row.seq,
                    published_at: c.row.published_at,
                    finding,
                    found_message_id,
                    found_subject,
                }
            })
            .collect(),
    };
    output::print(&out, json)
}

fn publisher_error(e: outbox_publisher::Error) -> Error {
    let kind = match e.kind() {
        outbox_publisher::ErrorKind::Broker | outbox_publisher::ErrorKind::Stream => {
            ErrorKind::Nats
        }
        outbox_publisher::ErrorKind::Config => ErrorKind::Config,
        _ => ErrorKind::Database,
    };
    Error::new(kind, e.to_string())
}
