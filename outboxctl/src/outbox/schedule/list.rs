//! `outboxctl schedule list`: the scheduled rows not published, cancelled or
//! skipped, next due first (the order the relay's due lane takes them: by
//! `next_attempt_at`, a row's due time or, after a failure, its next
//! attempt).
//!
//! Read from the due lane's index (`outbox_events_due_idx`) only, per shard
//! up to `--due-before` (only the subject's shard with `--subject`): the list
//! reads at most `--limit` rows per shard; the total reads the due lane's rows
//! in that range, never the rest of the table.
//!
//! `--json` prints `{"total": n, "rows": [{"id", "event_type", "subject",
//! "state", "due_at", "due_in_secs", "next_attempt_at", "next_in_secs",
//! "attempts", "last_error", "created_at", "released_at"}]}`: `total` counts
//! every row the filters match, however many `--limit` lets through;
//! `due_in_secs` is negative once the row is late; `state` is one of
//! `waiting`, `due`, `publishing`, `backoff`, `parked` (see the module docs
//! of `schedule`).

use std::io::Write;

use chrono::{DateTime, Utc};
use outbox_pg::SHARDS;
use serde::Serialize;
use uuid::Uuid;

use super::{Facts, State, from_now};
use crate::db::Database;
use crate::error::{Error, Result};
use crate::outbox::{Cap, TABLE, short, shown};
use crate::output::{Report, print, table, when};
use crate::time::{Until, parse_until};

/// Flags of `outboxctl schedule list`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    cap: Cap,

    /// List at most this many rows (the total is always given).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(0..))]
    limit: i64,

    /// Only rows of this event type.
    #[arg(long = "type", value_name = "EVENT_TYPE")]
    event_type: Option<String>,

    /// Only rows of this entity (envelope subject).
    #[arg(long, value_name = "SUBJECT")]
    subject: Option<String>,

    /// Only rows next due at or before this time: RFC 3339
    /// (2026-12-01T09:00:00Z) or a duration from now (10m, 2h, 3d).
    #[arg(long, value_name = "TIME", value_parser = parse_until)]
    due_before: Option<Until>,
}

#[derive(Debug, Serialize)]
struct Row {
    id: Uuid,
    event_type: String,
    subject: String,
    state: State,
    due_at: Option<DateTime<Utc>>,
    due_in_secs: Option<f64>,
    next_attempt_at: Option<DateTime<Utc>>,
    next_in_secs: Option<f64>,
    attempts: i32,
    last_error: Option<String>,
    created_at: Option<DateTime<Utc>>,
    released_at: Option<DateTime<Utc>>,
}

/// What `outboxctl schedule list` prints.
#[derive(Debug, Serialize)]
struct List {
    total: i64,
    rows: Vec<Row>,
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let pool = db.connect(&[TABLE]).await?;
    let (event_type, subject) = (args.event_type.as_deref(), args.subject.as_deref());
    let (before, before_ms) = Until::split(args.due_before);
    let shards: Vec<i16> = (0..SHARDS).filter_map(|s| i16::try_from(s).ok()).collect();
    let total = sqlx::query_file_scalar!(
        "queries/schedule_count.sql",
        &shards,
        event_type,
        subject,
        before,
        before_ms
    )
    .fetch_one(&pool)
    .await
    .map_err(|e| Error::database("counting scheduled rows", e))?;
    let rows = sqlx::query_file!(
        "queries/schedule_list.sql",
        &shards,
        event_type,
        subject,
        before,
        args.limit,
        args.cap.max_attempts,
        before_ms
    )
    .fetch_all(&pool)
    .await
    .map_err(|e| Error::database("listing scheduled rows", e))?
    .into_iter()
    .map(|r| Row {
        state: State::of(Facts {
            scheduled: true,
            fallen_due: r.fallen_due,
            released: r.released,
            parked: r.parked,
            attempts: r.attempts,
            retry_later: r.next_in_secs.is_some_and(|s| s > 0.0),
            ..Facts::default()
        }),
        id: r.id,
        event_type: r.event_type,
        subject: r.subject,
        due_at: r.due_at,
        due_in_secs: r.due_in_secs,
        next_attempt_at: r.next_attempt_at,
        next_in_secs: r.next_in_secs,
        attempts: r.attempts,
        last_error: r.last_error,
        created_at: r.created_at,
        released_at: r.released_at,
    })
    .collect();
    print(&List { total, rows }, json)
}

impl Row {
    /// The state column: the state, and for a failed row when it is tried
    /// again.
    fn state_cell(&self) -> String {
        match self.state {
            State::Backoff => format!("backoff, next {}", from_now(self.next_in_secs, "ago")),
            state => state.as_str().to_owned(),
        }
    }
}

impl Report for List {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        if self.total == 0 {
            return writeln!(out, "no scheduled rows");
        }
        let mut rows = vec![
            [
                "id",
                "type",
                "subject",
                "due",
                "when",
                "state",
                "attempts",
                "last error",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for r in &self.rows {
            rows.push(vec![
                r.id.to_string(),
                shown(&r.event_type),
                shown(&r.subject),
                when(r.due_at),
                from_now(r.due_in_secs, "late"),
                r.state_cell(),
                r.attempts.to_string(),
                short(r.last_error.as_deref().unwrap_or("-"), 60),
            ]);
        }
        table(out, &rows)?;
        if (self.rows.len() as i64) < self.total {
            writeln!(
                out,
                "{} of {} scheduled rows shown (next due first; --limit)",
                self.rows.len(),
                self.total
            )
        } else {
            writeln!(
                out,
                "{} scheduled row{}",
                self.total,
                if self.total == 1 { "" } else { "s" }
            )
        }
    }
}
