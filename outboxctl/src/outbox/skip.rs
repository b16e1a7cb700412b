//! `outboxctl skip <id> --reason …`: abandons a poison row so the rows of its
//! subject behind it move on.
//!
//! The row is kept and recorded, never deleted and never reported as
//! published: `skipped_at`, `skipped_by` (`--by`, by default `$USER@host`,
//! with the database role) and `skip_reason` are set, `published_at` stays
//! null, and `next_attempt_at` becomes `'infinity'`, out of both of the
//! relay's lanes. The relay passes over a skipped row when it looks for an
//! earlier row of a subject, so the rows deferred behind it are made due now
//! in the same transaction and a running relay publishes them at once.
//!
//! One short transaction: the row is locked (`for update`), checked (unknown,
//! published or already skipped: refused, naming why), marked, and its
//! followers woken.
//!
//! A scheduled row no relay has taken yet is refused: `outboxctl schedule
//! cancel` is what keeps it from being published (a cancelled row is refused
//! too: it never will be). A scheduled row that fell due and failed is
//! skipped like any row; it has no followers (it is outside its entity's
//! order).
//!
//! The race: a relay publishing that very row at that moment may still get
//! its ack and mark it published; the row then has `published_at` set as well
//! as `skipped_at` — which is the truth, since the message is on the stream.
//!
//! `--json` prints `{"id", "subject", "skipped_at", "skipped_by", "reason",
//! "woken": [ids]}`.

use std::io::Write;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use super::{TABLE, host, os_user, parse_ids, shown};
use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::when;
use crate::output::{Report, print};

/// Flags of `outboxctl skip`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The event id of the row to abandon.
    #[arg(value_name = "ID")]
    id: String,

    /// Why (required; recorded on the row).
    #[arg(long)]
    reason: String,

    /// Who (recorded on the row, with the database role). Default: $USER (or
    /// $LOGNAME) @ this host.
    #[arg(long, value_name = "WHO")]
    by: Option<String>,
}

/// What `outboxctl skip` prints.
#[derive(Debug, Serialize)]
struct Skipped {
    id: Uuid,
    subject: String,
    skipped_at: DateTime<Utc>,
    skipped_by: String,
    reason: String,
    /// Rows of the subject deferred behind it, made due now.
    woken: Vec<Uuid>,
}

/// `$USER@host` (or `$LOGNAME`), for `--by`'s default.
fn operator() -> String {
    format!(
        "{}@{}",
        os_user().unwrap_or_else(|| "unknown".to_owned()),
        host()
    )
}

/// The row to skip, locked, and the database role skipping it.
#[derive(Debug)]
struct Locked {
    id: Uuid,
    subject: String,
    seq: i64,
    published_at: Option<DateTime<Utc>>,
    skipped_at: Option<DateTime<Utc>>,
    skipped_by: Option<String>,
    skip_reason: Option<String>,
    cancelled_at: Option<DateTime<Utc>>,
    cancelled_by: Option<String>,
    /// Scheduled, and no relay has taken it yet.
    unreleased_schedule: bool,
    role: String,
}

/// Refuses, saying why, a row skipped already, published, cancelled, or
/// scheduled and not taken by a relay yet (to be cancelled instead).
fn check_skippable(row: &Locked) -> Result<()> {
    let id = row.id;
    let refuse = |message: String| Err(Error::new(ErrorKind::InvalidState, message));
    if let Some(skipped_at) = &row.skipped_at {
        return refuse(format!(
            "row {id} was already skipped at {} by {} ({})",
            when(Some(*skipped_at)),
            row.skipped_by.as_deref().unwrap_or("an unknown operator"),
            row.skip_reason.as_deref().unwrap_or("no reason recorded")
        ));
    }
    if let Some(published_at) = &row.published_at {
        return refuse(format!(
            "row {id} was published at {}: nothing to skip",
            when(Some(*published_at))
        ));
    }
    if let Some(cancelled_at) = &row.cancelled_at {
        return refuse(format!(
            "row {id} was cancelled at {} by {}: it is never published; nothing to skip",
            when(Some(*cancelled_at)),
            row.cancelled_by
                .as_deref()
                .unwrap_or("an unknown canceller")
        ));
    }
    if row.unreleased_schedule {
        return refuse(format!(
            "row {id} is a scheduled event no relay has taken yet: cancel it with \
             `outboxctl schedule cancel {id}`; nothing was changed"
        ));
    }
    Ok(())
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let id = parse_ids(std::slice::from_ref(&args.id))?
        .into_iter()
        .next()
        .ok_or_else(|| Error::new(ErrorKind::Config, "no event id given"))?;
    let reason = args.reason.trim();
    if reason.is_empty() {
        return Err(Error::new(
            ErrorKind::Config,
            "--reason is empty: say why the row is abandoned (it is recorded on the row)",
        ));
    }
    let by = match &args.by {
        Some(by) if by.trim().is_empty() => {
            return Err(Error::new(ErrorKind::Config, "--by is empty"));
        }
        Some(by) => by.trim().to_owned(),
        None => operator(),
    };

    let pool = db.connect(&[TABLE]).await?;
    let mut tx = super::begin(&pool).await?;
    let row = sqlx::query_file_as!(Locked, "queries/skip_lock.sql", id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(|e| Error::database("locking the row", e))?
        .ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("no outbox row with id {id}; nothing was changed"),
            )
        })?;
    check_skippable(&row)?;
    let skipped_by = format!("{by} (role {})", row.role);
    let skipped_at = sqlx::query_file_scalar!("queries/skip_mark.sql", id, &skipped_by, reason)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| Error::database("marking the row skipped", e))?;
    let woken = sqlx::query_file_scalar!("queries/skip_wake.sql", &row.subject, row.seq)
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| Error::database("waking the rows behind it", e))?;
    tx.commit()
        .await
        .map_err(|e| Error::database("committing the skip", e))?;
    print(
        &Skipped {
            id,
            subject: row.subject,
            skipped_at,
            skipped_by,
            reason: reason.to_owned(),
            woken,
        },
        json,
    )
}

impl Report for Skipped {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(
            out,
            "skipped {} (subject {}) at {} by {}: {}",
            self.id,
            shown(&self.subject),
            when(Some(self.skipped_at)),
            self.skipped_by,
            self.reason
        )?;
        writeln!(
            out,
            "{} row{} deferred behind it due now; the row is kept, never published",
            self.woken.len(),
            if self.woken.len() == 1 { "" } else { "s" }
        )
    }
}
