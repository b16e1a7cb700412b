//! `outboxctl dead-letters list`.
//!
//! `--json`:
//!
//! ```text
//! {"total": 3,                      // rows the filters match, beyond --limit too
//!  "dead_letters": [{"id": 7, "consumer": "billing", "stream": "OUTBOX", "stream_sequence": 42,
//!                    "subject": "invoice.raised", "event_id": "…" | null, "delivery_count": 1,
//!                    "reason": "rejected", "error": "…", "created_at": "…",
//!                    "replay_count": 0, "replayed_at": null, "payload_bytes": 210}]}
//! ```

use std::io::Write;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::db::Database;
use crate::error::{Error, Result};
use crate::output::when;
use crate::output::{self, Report};

/// Flags of `outboxctl dead-letters list`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Only this consumer's (durable name).
    #[arg(long, value_name = "C")]
    consumer: Option<String>,

    /// Only this reason: not_json, not_cloudevent, invalid_id,
    /// undecodable_payload, unroutable, rejected, max_deliveries, panic.
    #[arg(long, value_name = "R")]
    reason: Option<String>,

    /// At most this many, newest first.
    #[arg(long, value_name = "N", default_value_t = 50)]
    limit: u32,
}

#[derive(Debug, Serialize)]
struct List {
    total: i64,
    dead_letters: Vec<Item>,
}

#[derive(Debug, Serialize)]
struct Item {
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
    payload_bytes: i32,
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let pool = db.connect(&["inbox_dead_letters"]).await?;
    let (consumer, reason) = (args.consumer.as_deref(), args.reason.as_deref());
    let dead_letters = sqlx::query_file_as!(
        Item,
        "queries/dead_letters_list.sql",
        consumer,
        reason,
        i64::from(args.limit)
    )
    .fetch_all(&pool)
    .await
    .map_err(|e| Error::database("listing inbox_dead_letters", e))?;
    let total = sqlx::query_file_scalar!("queries/dead_letters_count.sql", consumer, reason)
        .fetch_one(&pool)
        .await
        .map_err(|e| Error::database("counting inbox_dead_letters", e))?;
    output::print(
        &List {
            total,
            dead_letters,
        },
        json,
    )
}

impl Report for List {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let mut rows = vec![
            [
                "id", "consumer", "subject", "event id", "reason", "created", "replays", "error",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for d in &self.dead_letters {
            let mut error: String = d
                .error
                .lines()
                .next()
                .unwrap_or("")
                .chars()
                .take(60)
                .collect();
            if error.len() < d.error.len() {
                error.push('…');
            }
            rows.push(vec![
                d.id.to_string(),
                d.consumer.clone(),
                d.subject.clone(),
                d.event_id
                    .map_or_else(|| "-".to_owned(), |id| id.to_string()),
                d.reason.clone(),
                when(Some(d.created_at)),
                d.replay_count.to_string(),
                error,
            ]);
        }
        output::table(out, &rows)?;
        writeln!(
            out,
            "{} of {} dead letter{}",
            self.dead_letters.len(),
            self.total,
            if self.total == 1 { "" } else { "s" }
        )
    }
}
