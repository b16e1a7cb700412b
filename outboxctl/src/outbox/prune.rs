//! `outboxctl prune [--dry-run]`: outbox retention, as the relay's
//! `--retention` does it: published rows older than the window, and scheduled
//! rows cancelled longer ago than the window (kept as the record until then),
//! are deleted in batches (`for update skip locked`, so a relay pruning at the
//! same time is not waited for), oldest first. Other unpublished rows and
//! skipped rows are never deleted. The cutoff is fixed, by the server's
//! clock, when the command starts.
//!
//! A progress bar is drawn on stderr when stderr is a terminal, never on a
//! pipe. `--dry-run` counts what would go and deletes nothing.
//!
//! `--json` prints `{"deleted": n, "deleted_published": n,
//! "deleted_cancelled": n, "dry_run": bool, "cutoff": t, "older_than_secs":
//! s}`: `deleted` is the sum of the two (with `--dry-run`, each is what would
//! be).

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
    deleted_published: u64,
    deleted_cancelled: u64,
    dry_run: bool,
    cutoff: DateTime<Utc>,
    older_than_secs: f64,
}

/// Rows deleted (or to be): published, and cancelled.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    published: u64,
    cancelled: u64,
}

impl Tally {
    fn of(published: i64, cancelled: i64) -> Self {
        Self {
            published: u64::try_from(published).unwrap_or(0),
            cancelled: u64::try_from(cancelled).unwrap_or(0),
        }
    }

    fn total(self) -> u64 {
        self.published + self.cancelled
    }
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
    let counted = if args.dry_run || terminal {
        count(&pool, cutoff).await?
    } else {
        Tally::default()
    };
    let tally = if args.dry_run {
        counted
    } else {
        let bar = terminal.then(|| progress_bar(counted.total()));
        delete(&pool, cutoff, args.batch, bar.as_ref()).await?
    };
    print(
        &Pruned {
            deleted: tally.total(),
            deleted_published: tally.published,
            deleted_cancelled: tally.cancelled,
            dry_run: args.dry_run,
            cutoff,
            older_than_secs: args.older_than.as_secs_f64(),
        },
        json,
    )
}

/// What would go.
async fn count(pool: &sqlx::PgPool, cutoff: DateTime<Utc>) -> Result<Tally> {
    let r = sqlx::query_file!("queries/prune_count.sql", cutoff)
        .fetch_one(pool)
        .await
        .map_err(|e| Error::database("counting the rows to prune", e))?;
    Ok(Tally::of(r.published, r.cancelled))
}

fn progress_bar(length: u64) -> ProgressBar {
    let bar = ProgressBar::new(length);
    if let Ok(style) = ProgressStyle::with_template("pruning {bar:40} {pos}/{len} rows, {eta} left")
    {
        bar.set_style(style);
    }
    bar
}

/// Deletes a batch at a time until none is left, moving `bar`.
async fn delete(
    pool: &sqlx::PgPool,
    cutoff: DateTime<Utc>,
    batch: i64,
    bar: Option<&ProgressBar>,
) -> Result<Tally> {
    let mut tally = Tally::default();
    loop {
        let r = sqlx::query_file!("queries/prune_batch.sql", cutoff, batch)
            .fetch_one(pool)
            .await
            .map_err(|e| Error::database("deleting published and cancelled rows", e))?;
        let done = Tally::of(r.published, r.cancelled);
        tally.published += done.published;
        tally.cancelled += done.cancelled;
        if let Some(bar) = bar {
            if tally.total() > bar.length().unwrap_or(0) {
                bar.set_length(tally.total());
            }
            bar.set_position(tally.total());
        }
        if done.total() == 0 {
            break;
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(tally)
}

impl Report for Pruned {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let window = humantime::format_duration(Duration::from_secs_f64(self.older_than_secs));
        let rows = |n: u64| if n == 1 { "" } else { "s" };
        let cancelled = if self.deleted_cancelled > 0 {
            format!(
                " and {} cancelled scheduled row{}",
                self.deleted_cancelled,
                rows(self.deleted_cancelled)
            )
        } else {
            String::new()
        };
        writeln!(
            out,
            "{} {} published row{}{cancelled} older than {window} (before {}){}",
            if self.dry_run {
                "would delete"
            } else {
                "deleted"
            },
            self.deleted_published,
            rows(self.deleted_published),
            when(Some(self.cutoff)),
            if self.dry_run {
                "; nothing deleted (--dry-run)"
            } else {
                ""
            }
        )
    }
}
