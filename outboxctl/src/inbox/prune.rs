//! `outboxctl inbox prune`: inbox retention by hand, through the library's
//! own pruning ([`inbox_consumer::Retention::prune`]: batches of 1,000 rows,
//! `FOR UPDATE SKIP LOCKED`).
//!
//! `--json`:
//!
//! ```text
//! {"dry_run": false, "older_than_seconds": 1209600, "cutoff": "…",
//!  "consumers": [{"consumer": "billing", "deleted": 120}],   // "would_delete" with --dry-run
//!  "total": 120}
//! ```

use std::time::Duration;

use super::select_consumers;
use crate::db::Database;
use crate::deleted::Deleted;
use crate::error::{Error, ErrorKind, Result};
use crate::output;
use crate::time::{cutoff, parse_duration};

/// The shortest window pruned without `--force`.
const SHORTEST_WINDOW: Duration = Duration::from_secs(60 * 60);

/// Flags of `outboxctl inbox prune`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Only this consumer (durable name).
    #[arg(long, value_name = "C")]
    consumer: Option<String>,

    /// Delete rows handled longer ago than this (30d, 12h, …). Default: 14
    /// days, the consumer runtime's own window.
    #[arg(long, value_name = "D", value_parser = parse_duration)]
    older_than: Option<Duration>,

    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,

    /// Allow a window shorter than 1 hour. A row pruned while its event can
    /// still be redelivered makes that redelivery a second effect.
    #[arg(long)]
    force: bool,
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let window = args
        .older_than
        .unwrap_or(inbox_consumer::retention::DEFAULT_WINDOW);
    if window < SHORTEST_WINDOW && !args.force {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "--older-than {} is shorter than 1h: an event redelivered after its inbox row is \
                 pruned is handled a second time; pass --force if that is what you want",
                humantime::format_duration(window)
            ),
        ));
    }
    let pool = db
        .connect(&["inbox_events", "inbox_dead_letters", "inbox_leases"])
        .await?;
    let consumers = select_consumers(&pool, args.consumer.as_deref()).await?;
    let cutoff = cutoff(window, "--older-than")?;
    let retention = inbox_consumer::Retention::default().window(window);
    let mut report = Deleted::new(args.dry_run, window, cutoff, "inbox row", "handled");
    for consumer in consumers {
        let count = if args.dry_run {
            let rows = sqlx::query_file_scalar!("queries/inbox_prune_count.sql", &consumer, cutoff)
                .fetch_one(&pool)
                .await
                .map_err(|e| Error::database("counting inbox rows past the window", e))?;
            u64::try_from(rows).unwrap_or(0)
        } else {
            retention.prune(&pool, &consumer).await.map_err(|e| {
                Error::new(
                    ErrorKind::Database,
                    format!(
                        "pruning the inbox of `{consumer}` (after {} rows of earlier consumers): {e}",
                        report.total()
                    ),
                )
            })?
        };
        report.push(consumer, count);
    }
    output::print(&report, json)
}
