//! `outboxctl stuck`: the rows that need an operator, oldest first: past the
//! attempt cap (parked) or failing, with their attempts and last error.
//!
//! A scheduled row is stuck once it fell due and failed (in backoff or
//! parked, in the due lane); waiting for its time it never is, and it is
//! never deferred (it is outside its entity's order).
//!
//! `--json` prints `{"total": n, "rows": [{"id", "subject", "event_type",
//! "attempts", "state", "next_attempt_at", "last_error", "created_at",
//! "due_at"}]}`: `total` counts every stuck row matching the filters, however
//! many `--limit` lets through; `state` is `parked` (past the cap), `backoff`
//! (due again at `next_attempt_at`) or `deferred` (behind an earlier failing
//! row of its subject); `due_at` is a scheduled row's due time (null for an
//! immediate row).

use std::io::Write;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::{Cap, TABLE, short, shown};
use crate::db::Database;
use crate::error::{Error, Result};
use crate::output::when;
use crate::output::{Report, age, print, table};

/// Flags of `outboxctl stuck`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    cap: Cap,

    /// List at most this many rows (the total is always given).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(0..))]
    limit: i64,

    /// Only rows of this entity (envelope subject).
    #[arg(long, value_name = "SUBJECT")]
    entity: Option<String>,

    /// Only rows of this event type.
    #[arg(long = "type", value_name = "EVENT_TYPE")]
    event_type: Option<String>,
}

#[derive(Debug, Serialize)]
struct Row {
    id: Uuid,
    subject: String,
    event_type: String,
    attempts: i32,
    state: String,
    next_attempt_at: Option<DateTime<Utc>>,
    last_error: Option<String>,
    created_at: Option<DateTime<Utc>>,
    due_at: Option<DateTime<Utc>>,
}

/// What `outboxctl stuck` prints.
#[derive(Debug, Serialize)]
struct Stuck {
    total: i64,
    rows: Vec<Row>,
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let pool = db.connect(&[TABLE]).await?;
    let entity = args.entity.as_deref();
    let event_type = args.event_type.as_deref();
    let total = sqlx::query_file_scalar!("queries/stuck_count.sql", entity, event_type)
        .fetch_one(&pool)
        .await
        .map_err(|e| Error::database("counting stuck rows", e))?;
    let rows = sqlx::query_file!(
        "queries/stuck_list.sql",
        args.cap.max_attempts,
        entity,
        event_type,
        args.limit
    )
    .fetch_all(&pool)
    .await
    .map_err(|e| Error::database("listing stuck rows", e))?
    .into_iter()
    .map(|r| Row {
        id: r.id,
        subject: r.subject,
        event_type: r.event_type,
        attempts: r.attempts,
        next_attempt_at: if r.state == "parked" {
            None
        } else {
            r.next_attempt_at
        },
        state: r.state,
        last_error: r.last_error,
        created_at: r.created_at,
        due_at: r.due_at,
    })
    .collect();
    print(&Stuck { total, rows }, json)
}

impl Report for Stuck {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        if self.total == 0 {
            return writeln!(out, "no stuck rows");
        }
        let now = Utc::now();
        let mut rows = vec![
            [
                "id",
                "subject",
                "type",
                "attempts",
                "state",
                "age",
                "last error",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for r in &self.rows {
            let state = match (r.state.as_str(), &r.next_attempt_at) {
                ("backoff", Some(t)) => format!("backoff until {}", when(Some(*t))),
                (s, _) => s.to_owned(),
            };
            let state = match r.due_at {
                Some(due) => format!("{state} (scheduled for {})", when(Some(due))),
                None => state,
            };
            let row_age = r.created_at.map_or_else(
                || "-".to_owned(),
                |t| age((now - t).num_milliseconds() as f64 / 1000.0),
            );
            rows.push(vec![
                r.id.to_string(),
                shown(&r.subject),
                shown(&r.event_type),
                r.attempts.to_string(),
                state,
                row_age,
                short(r.last_error.as_deref().unwrap_or("-"), 80),
            ]);
        }
        table(out, &rows)?;
        if (self.rows.len() as i64) < self.total {
            writeln!(
                out,
                "{} of {} stuck rows shown (oldest first; --limit)",
                self.rows.len(),
                self.total
            )?;
        } else {
            writeln!(out, "{} stuck rows", self.total)?;
        }
        Ok(())
    }
}
