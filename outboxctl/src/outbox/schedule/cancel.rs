//! `outboxctl schedule cancel <id>… [--by NAME]`: cancels scheduled rows
//! through the library's rule (`outbox_pg::Outbox::cancel_as`), one short
//! transaction per id (with the lock and statement timeouts of `retry` and
//! `skip`), committed before the next id.
//!
//! Each id gets the library's answer: `cancelled` (never published: by this
//! command, or by an earlier cancel, which keeps its own time and name),
//! `already_published` (published, taken by a relay to be published, or never
//! scheduled: an immediate event) or `unknown` (no such row: never written,
//! rolled back, or deleted by retention); `failed` if a statement failed
//! (the id's transaction rolled back, nothing changed). A cancel that meets a
//! relay taking the row waits for it and answers `already_published`: never
//! both published and cancelled.
//!
//! `--by` is recorded as `cancelled_by`; by default `outboxctl:$USER@host`
//! (or `$LOGNAME`), else the database role.
//!
//! Exit status 0 when every id was cancelled; 1 when any was not (the
//! answers are printed all the same, and one line on stderr counts them).
//!
//! `--json` prints `{"cancelled": n, "not_cancelled": n, "results": [{"id",
//! "answer", "earlier", "detail", "due_at", "cancelled_at", "cancelled_by",
//! "released_at", "published_at"}]}`: `earlier` is true for a row an earlier
//! cancel had cancelled.

use std::io::Write;

use chrono::{DateTime, Utc};
use outbox_pg::{Cancellation, EventId, Outbox};
use serde::Serialize;
use uuid::Uuid;

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::outbox::{TABLE, begin, host, os_user, parse_ids};
use crate::output::{Report, print, when};

/// Flags of `outboxctl schedule cancel`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Event ids of the scheduled rows to cancel.
    #[arg(value_name = "ID", required = true)]
    ids: Vec<String>,

    /// Who cancels (recorded as cancelled_by). Default: outboxctl:$USER@host,
    /// else the database role.
    #[arg(long, value_name = "NAME")]
    by: Option<String>,
}

/// One id's answer.
#[derive(Debug, Serialize)]
struct Answer {
    id: Uuid,
    /// `cancelled`, `already_published`, `unknown` or `failed`.
    answer: &'static str,
    /// Cancelled before this command.
    earlier: bool,
    detail: String,
    due_at: Option<DateTime<Utc>>,
    cancelled_at: Option<DateTime<Utc>>,
    cancelled_by: Option<String>,
    released_at: Option<DateTime<Utc>>,
    published_at: Option<DateTime<Utc>>,
}

/// What `outboxctl schedule cancel` prints.
#[derive(Debug, Serialize)]
struct Cancelled {
    cancelled: usize,
    not_cancelled: usize,
    results: Vec<Answer>,
}

/// The transaction each id is cancelled in.
type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<bool> {
    let mut ids = parse_ids(&args.ids)?;
    let mut seen = std::collections::HashSet::new();
    ids.retain(|id| seen.insert(*id));
    let by = match &args.by {
        Some(by) if by.trim().is_empty() => {
            return Err(Error::new(ErrorKind::Config, "--by is empty"));
        }
        Some(by) => Some(by.trim().to_owned()),
        None => os_user().map(|user| format!("outboxctl:{user}@{}", host())),
    };
    let pool = db.connect(&[TABLE]).await?;
    let mut results = Vec::with_capacity(ids.len());
    for id in ids {
        let answer = match cancel_one(&pool, id, by.as_deref()).await {
            Ok(answer) => answer,
            Err(e) => failed(id, &e),
        };
        results.push(answer);
    }
    let cancelled = results.iter().filter(|a| a.answer == "cancelled").count();
    let report = Cancelled {
        cancelled,
        not_cancelled: results.len() - cancelled,
        results,
    };
    print(&report, json)?;
    if report.not_cancelled > 0 {
        eprintln!(
            "outboxctl: {} of {} id{} not cancelled",
            report.not_cancelled,
            report.results.len(),
            if report.results.len() == 1 { "" } else { "s" }
        );
    }
    Ok(report.not_cancelled == 0)
}

/// Cancels `id` in a transaction of its own, reads the row as the cancel
/// left it, and commits.
async fn cancel_one(pool: &sqlx::PgPool, id: Uuid, by: Option<&str>) -> Result<Answer> {
    let mut tx = begin(pool).await?;
    let cancellation = Outbox::unvalidated()
        .cancel_as(&mut tx, EventId::from_uuid(id), by)
        .await
        .map_err(|e| Error::new(ErrorKind::Database, e.to_string()))?;
    let answer = read_back(&mut tx, id, cancellation).await?;
    tx.commit()
        .await
        .map_err(|e| Error::database("committing the cancel", e))?;
    Ok(answer)
}

/// The answer for `id`, with the row's columns as the cancel left them.
async fn read_back(tx: &mut Tx, id: Uuid, cancellation: Cancellation) -> Result<Answer> {
    let row = sqlx::query_file!("queries/schedule_cancelled.sql", id)
        .fetch_optional(&mut **tx)
        .await
        .map_err(|e| Error::database("reading the row back", e))?;
    let mut answer = Answer {
        id,
        answer: "unknown",
        earlier: false,
        detail: "unknown: no outbox row with this id (never written, rolled back, or deleted by \
                 retention)"
            .to_owned(),
        due_at: None,
        cancelled_at: None,
        cancelled_by: None,
        released_at: None,
        published_at: None,
    };
    let Some(r) = row else {
        return Ok(answer);
    };
    answer.due_at = r.due_at;
    answer.cancelled_at = r.cancelled_at;
    answer.cancelled_by = r.cancelled_by;
    answer.released_at = r.released_at;
    answer.published_at = r.published_at;
    answer.earlier = r.cancelled_at.is_some() && !r.by_this;
    (answer.answer, answer.detail) = match cancellation {
        Cancellation::Cancelled => (
            "cancelled",
            format!(
                "cancelled{} at {} by {} (was due {}): never published",
                if answer.earlier { " earlier" } else { "" },
                when(answer.cancelled_at),
                answer.cancelled_by.as_deref().unwrap_or("-"),
                when(answer.due_at)
            ),
        ),
        Cancellation::Unknown => return Ok(answer),
        _ => (
            "already_published",
            too_late(r.scheduled, answer.published_at, answer.released_at),
        ),
    };
    Ok(answer)
}

/// Why a cancel answered "already published".
fn too_late(
    scheduled: bool,
    published_at: Option<DateTime<Utc>>,
    released_at: Option<DateTime<Utc>>,
) -> String {
    if !scheduled {
        "already published: not scheduled (an immediate event, published or on its way)".to_owned()
    } else if published_at.is_some() {
        format!("already published at {}", when(published_at))
    } else {
        format!(
            "already published: taken by a relay at {} to be published (too late to cancel)",
            when(released_at)
        )
    }
}

/// The answer for an id whose cancel failed (its transaction rolled back).
fn failed(id: Uuid, e: &Error) -> Answer {
    Answer {
        id,
        answer: "failed",
        earlier: false,
        detail: format!("failed, nothing changed: {e}"),
        due_at: None,
        cancelled_at: None,
        cancelled_by: None,
        released_at: None,
        published_at: None,
    }
}

impl Report for Cancelled {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        for a in &self.results {
            writeln!(out, "{}  {}", a.id, a.detail)?;
        }
        writeln!(
            out,
            "{} of {} cancelled",
            self.cancelled,
            self.results.len()
        )
    }
}
