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

use std::io::Write;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::inbox::{cutoff, parse_duration, when};
use crate::output::{self, Report};

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

#[derive(Debug, Serialize)]
struct Purged {
    dry_run: bool,
    older_than_seconds: f64,
    cutoff: DateTime<Utc>,
    consumers: Vec<ConsumerPurged>,
    total: u64,
}

#[derive(Debug, Serialize)]
struct ConsumerPurged {
    consumer: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    deleted: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    would_delete: Option<u64>,
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
    let mut report = Purged {
        dry_run: args.dry_run,
        older_than_seconds: args.older_than.as_secs_f64(),
        cutoff,
        consumers: Vec::with_capacity(due.len()),
        total: 0,
    };
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
                        row.consumer, report.total
                    ),
                )
            })?
        };
        report.total += count;
        report.consumers.push(ConsumerPurged {
            consumer: row.consumer,
            deleted: (!args.dry_run).then_some(count),
            would_delete: args.dry_run.then_some(count),
        });
    }
    output::print(&report, json)
}

impl Report for Purged {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let verb = if self.dry_run {
            "would delete"
        } else {
            "deleted"
        };
        if !self.consumers.is_empty() {
            let mut rows = vec![vec!["consumer".to_owned(), verb.to_owned()]];
            for c in &self.consumers {
                let n = c.deleted.or(c.would_delete).unwrap_or(0);
                rows.push(vec![c.consumer.clone(), n.to_string()]);
            }
            output::table(out, &rows)?;
        }
        writeln!(
            out,
            "{verb} {} dead letter{} recorded before {} (older than {})",
            self.total,
            if self.total == 1 { "" } else { "s" },
            when(Some(self.cutoff)),
            output::age(self.older_than_seconds)
        )
    }
}
