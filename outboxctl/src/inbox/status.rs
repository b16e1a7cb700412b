//! `outboxctl inbox status`.
//!
//! `--json`:
//!
//! ```text
//! {"consumers": [{"consumer": "billing",
//!                 "inbox": {"rows": 12, "oldest_handled_at": "…", "newest_handled_at": "…",
//!                           "oldest_age_seconds": 3600.5},
//!                 "dead_letters": {"total": 1, "not_replayed": 1, "newest_created_at": "…"},
//!                 "lease": null | {"holder": "host:pid", "epoch": 3, "acquired_at": "…",
//!                                  "released": false}}]}
//! ```
//!
//! Timestamps are RFC 3339 (null when there is none), ages in seconds.

use std::io::Write;

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::select_consumers;
use crate::db::Database;
use crate::error::{Error, Result};
use crate::output::when;
use crate::output::{self, Report};

/// Flags of `outboxctl inbox status`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Only this consumer (durable name).
    #[arg(long, value_name = "C")]
    consumer: Option<String>,
}

#[derive(Debug, Serialize)]
struct Status {
    consumers: Vec<ConsumerStatus>,
}

#[derive(Debug, Serialize)]
struct ConsumerStatus {
    consumer: String,
    inbox: Inbox,
    dead_letters: DeadLetters,
    lease: Option<Lease>,
}

#[derive(Debug, Serialize)]
struct Inbox {
    rows: i64,
    oldest_handled_at: Option<DateTime<Utc>>,
    newest_handled_at: Option<DateTime<Utc>>,
    oldest_age_seconds: Option<f64>,
}

#[derive(Debug, Serialize)]
struct DeadLetters {
    total: i64,
    not_replayed: i64,
    newest_created_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Serialize)]
struct Lease {
    holder: String,
    epoch: i64,
    acquired_at: DateTime<Utc>,
    released: bool,
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let pool = db
        .connect(&["inbox_events", "inbox_dead_letters", "inbox_leases"])
        .await?;
    let consumers = select_consumers(&pool, args.consumer.as_deref()).await?;
    let rows = sqlx::query_file!("queries/inbox_status.sql", &consumers)
        .fetch_all(&pool)
        .await
        .map_err(|e| Error::database("reading the inboxes", e))?;
    let consumers = rows
        .into_iter()
        .map(|r| ConsumerStatus {
            consumer: r.consumer,
            inbox: Inbox {
                rows: r.inbox_rows,
                oldest_handled_at: r.oldest_handled_at,
                newest_handled_at: r.newest_handled_at,
                oldest_age_seconds: r.oldest_age_seconds,
            },
            dead_letters: DeadLetters {
                total: r.dead_letters,
                not_replayed: r.dead_letters_not_replayed,
                newest_created_at: r.newest_dead_letter_at,
            },
            lease: match (r.lease_holder, r.lease_epoch, r.lease_acquired_at) {
                (Some(holder), Some(epoch), Some(acquired_at)) => Some(Lease {
                    holder,
                    epoch,
                    acquired_at,
                    released: r.lease_released.unwrap_or(false),
                }),
                _ => None,
            },
        })
        .collect();
    output::print(&Status { consumers }, json)
}

impl Report for Status {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        if self.consumers.is_empty() {
            return writeln!(out, "no consumers: the inbox tables are empty");
        }
        let mut rows = vec![
            [
                "consumer",
                "inbox rows",
                "oldest handled",
                "newest handled",
                "dead letters",
                "not replayed",
                "newest dead letter",
                "lease",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for c in &self.consumers {
            let oldest = match (c.inbox.oldest_handled_at, c.inbox.oldest_age_seconds) {
                (Some(at), Some(age)) => format!("{} ({} ago)", when(Some(at)), output::age(age)),
                (at, _) => when(at),
            };
            let lease = c.lease.as_ref().map_or_else(
                || "-".to_owned(),
                |l| {
                    format!(
                        "{} epoch {} since {}{}",
                        l.holder,
                        l.epoch,
                        when(Some(l.acquired_at)),
                        if l.released { " (released)" } else { "" }
                    )
                },
            );
            rows.push(vec![
                c.consumer.clone(),
                c.inbox.rows.to_string(),
                oldest,
                when(c.inbox.newest_handled_at),
                c.dead_letters.total.to_string(),
                c.dead_letters.not_replayed.to_string(),
                when(c.dead_letters.newest_created_at),
                lease,
            ]);
        }
        output::table(out, &rows)
    }
}
