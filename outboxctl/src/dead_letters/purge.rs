//! `outboxctl dead-letters purge --older-than D`: dead-letter retention by
//! hand, per consumer, through the library's own pruning
//! ([`inbox_consumer::retention::prune_dead_letters`]: batches of 1,000 rows,
//! `FOR UPDATE SKIP LOCKED`, so it never waits on a dead letter being written
//! or replayed).
//!
//! `--json`:
//!
//! ```text
//! {"dry_run": false, "older_than_seconds": 2592000, "cutoff": "…",
//!  "consumers": [{"consumer": "billing", "deleted": 3}],   // "would_delete" with --dry-run
//!  "total": 3}
//! ```

use std::time::Duration;

use crate::db::Database;
use crate::deleted::Deleted;
use crate::error::{Error, ErrorKind, Result};
use crate::output;
use crate::time::{cutoff, parse_duration};

/// Flags of `outboxctl dead-letters purge`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Delete dead letters recorded longer ago than this (30d, 12h, …).
    #[arg(long, value_name = "D", value_parser = parse_duration)]
    older_than: Duration,

    /// Only this consumer's (durable name).
    #[arg(long, value_name = "C")]
    consumer: Option<String>,

    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let pool = db.connect(&["inbox_dead_letters"]).await?;
    let cutoff = cutoff(args.older_than, "--older-than")?;
    let due = sqlx::query_file!(
        "queries/dead_letters_purge_count.sql",
        args.consumer.as_deref(),
        cutoff
    )
    .fetch_all(&pool)
    .await
    .map_err(|e| Error::database("counting dead letters past the window", e))?;
    let mut report = Deleted::new(
        args.dry_run,
        args.older_than,
        cutoff,
        "dead letter",
        "recorded",
    )
    .without_empty_table();
    for row in due {
        let count = if args.dry_run {
            u64::try_from(row.rows).unwrap_or(0)
        } else {
            inbox_consumer::retention::prune_dead_letters(
                &pool,
                Some(&row.consumer),
                args.older_than,
            )
            .await
            .map_err(|e| {
                Error::new(
                    ErrorKind::Database,
                    format!(
                        "purging the dead letters of `{}` (after {} of earlier consumers): {e}",
                        row.consumer,
                        report.total()
                    ),
                )
            })?
        };
        report.push(row.consumer, count);
    }
    output::print(&report, json)
}
