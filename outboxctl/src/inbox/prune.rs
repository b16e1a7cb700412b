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

use std::io::Write;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::{cutoff, parse_duration, select_consumers, when};
use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::{self, Report};

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

#[derive(Debug, Serialize)]
struct Pruned {
    dry_run: bool,
    older_than_seconds: f64,
    cutoff: DateTime<Utc>,
    consumers: Vec<ConsumerPruned>,
    total: u64,
}

#[derive(Debug, Serialize)]
struct ConsumerPruned {
    consumer: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    deleted: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    would_delete: Option<u64>,
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
    let mut report = Pruned {
        dry_run: args.dry_run,
        older_than_seconds: window.as_secs_f64(),
        cutoff,
        consumers: Vec::with_capacity(consumers.len()),
        total: 0,
    };
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
                        report.total
                    ),
                )
            })?
        };
        report.total += count;
        report.consumers.push(ConsumerPruned {
            consumer,
            deleted: (!args.dry_run).then_some(count),
            would_delete: args.dry_run.then_some(count),
        });
    }
    output::print(&report, json)
}

impl Report for Pruned {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let verb = if self.dry_run {
            "would delete"
        } else {
            "deleted"
        };
        let mut rows = vec![vec!["consumer".to_owned(), verb.to_owned()]];
        for c in &self.consumers {
            let n = c.deleted.or(c.would_delete).unwrap_or(0);
            rows.push(vec![c.consumer.clone(), n.to_string()]);
        }
        output::table(out, &rows)?;
        writeln!(
            out,
            "{verb} {} inbox row{} handled before {} (older than {})",
            self.total,
            if self.total == 1 { "" } else { "s" },
            when(Some(self.cutoff)),
            output::age(self.older_than_seconds)
        )
    }
}
