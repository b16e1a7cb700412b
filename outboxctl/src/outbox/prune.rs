//! `outboxctl prune [--dry-run]`: outbox retention, as the relay's
//! `--retention` does it: published rows older than the window are deleted
//! in batches (`for update skip locked`, so a relay pruning at the same time
//! is not waited for), oldest first. Unpublished rows and skipped rows are
//! never deleted. The cutoff is fixed, by the server's clock, when the
//! command starts.
//!
//! A progress bar is drawn on stderr when stderr is a terminal, never on a
//! pipe. `--dry-run` counts what would go and deletes nothing.
//!
//! `--json` prints `{"deleted": n, "dry_run": bool, "cutoff": t,
//! "older_than_secs": s}` (with `--dry-run`, `deleted` is what would be).

use std::io::{IsTerminal, Write};
use std::time::Duration;

use chrono::{DateTime, Utc};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::TABLE;
use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::when;
use crate::output::{Report, print};

/// Flags of `outboxctl prune`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,

    /// The retention window: published rows older than this go (as the
    /// relay's --retention).
    #[arg(
        long,
        env = "OUTBOX_RETENTION",
        default_value = "7d",
        value_parser = humantime::parse_duration
    )]
    older_than: Duration,

    /// Rows deleted per statement.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    batch: i64,
}

/// What `outboxctl prune` prints.
#[derive(Debug, Serialize)]
struct Pruned {
    deleted: u64,
    dry_run: bool,
    cutoff: DateTime<Utc>,
    older_than_secs: f64,
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let window_ms = i64::try_from(args.older_than.as_millis()).map_err(|_| {
        Error::new(
            ErrorKind::Config,
            format!("--older-than {:?} is too long", args.older_than),
        )
    })?;
    let pool = db.connect(&[TABLE]).await?;
    let cutoff = sqlx::query_file_scalar!("queries/prune_cutoff.sql", window_ms)
        .fetch_one(&pool)
        .await
        .map_err(|e| Error::database("reading the cutoff", e))?;
    let terminal = std::io::stderr().is_terminal();
    let deleted = if args.dry_run || terminal {
        let count = sqlx::query_file_scalar!("queries/prune_count.sql", cutoff)
            .fetch_one(&pool)
            .await
            .map_err(|e| Error::database("counting the rows to prune", e))?;
        u64::try_from(count).unwrap_or(0)
    } else {
        0
    };
    let deleted = if args.dry_run {
        deleted
    } else {
        let bar = terminal.then(|| {
            let bar = ProgressBar::new(deleted);
            if let Ok(style) =
                ProgressStyle::with_template("pruning {bar:40} {pos}/{len} rows, {eta} left")
            {
                bar.set_style(style);
            }
            bar
        });
        let mut total: u64 = 0;
        loop {
            let done = sqlx::query_file!("queries/prune_batch.sql", cutoff, args.batch)
                .execute(&pool)
                .await
                .map_err(|e| Error::database("deleting published rows", e))?
                .rows_affected();
            total += done;
            if let Some(bar) = &bar {
                if total > bar.length().unwrap_or(0) {
                    bar.set_length(total);
                }
                bar.set_position(total);
            }
            if done == 0 {
                break;
            }
        }
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        total
    };
    print(
        &Pruned {
            deleted,
            dry_run: args.dry_run,
            cutoff,
            older_than_secs: args.older_than.as_secs_f64(),
        },
        json,
    )
}

impl Report for Pruned {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let window = humantime::format_duration(Duration::from_secs_f64(self.older_than_secs));
        if self.dry_run {
            writeln!(
                out,
                "would delete {} published row{} older than {window} (before {}); nothing deleted (--dry-run)",
                self.deleted,
                if self.deleted == 1 { "" } else { "s" },
                when(Some(self.cutoff))
            )
        } else {
            writeln!(
                out,
                "deleted {} published row{} older than {window} (before {})",
                self.deleted,
                if self.deleted == 1 { "" } else { "s" },
                when(Some(self.cutoff))
            )
        }
    }
}
