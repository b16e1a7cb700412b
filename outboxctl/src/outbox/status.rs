//! `outboxctl status`: what is waiting in the outbox and why, at a glance.
//!
//! One set of queries that stays cheap on a big table: the counts read only
//! unpublished rows (partial indexes on `published_at is null`), the last
//! hour only that range of `outbox_events_published_idx`, blocked subjects
//! only the retry lane; relays come from `pg_locks`.
//!
//! `--json` prints one object:
//!
//! ```text
//! { "max_attempts": 20,
//!   "totals": { "unpublished", "fresh", "in_backoff", "deferred", "parked", "skipped",
//!               "oldest_unpublished_age_secs" (null when none), "published_last_hour" },
//!   "event_types": [ { "event_type", …the same fields… } ],
//!   "blocked_subjects": { "total", "shown": [ { "subject", "shard", "head_id", "event_type",
//!                          "attempts", "last_error", "created_at", "waiting" } ] },
//!   "relays": [ { "pid", "application_name", "client_addr", "backend_start", "state",
//!                 "workers", "shards": [..] } ],
//!   "shards_owned": n,
//!   "consumer_leaders": [ { "consumer", "holder", "epoch", "acquired_at", "released" } ] }
//! ```
//!
//! `unpublished` is the backlog: every row not yet published and not
//! skipped, in whichever state. `consumer_leaders` is null when the database
//! has no `inbox_leases` table.

use std::collections::BTreeMap;
use std::io::Write;

use chrono::{DateTime, Utc};
use outbox_pg::SHARDS;
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::{Cap, TABLE, short, shown};
use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::when;
use crate::output::{Report, age, print, table};

/// Flags of `outboxctl status`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(flatten)]
    cap: Cap,

    /// How many blocked subjects to list (those with the most rows waiting);
    /// the total is always given.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i64).range(0..))]
    blocked: i64,
}

/// Counts of one event type, or of all.
#[derive(Debug, Default, Serialize)]
struct Counts {
    /// Not published and not skipped: the backlog.
    unpublished: i64,
    /// In the main lane, claimable now.
    fresh: i64,
    /// Failed, below the cap, waiting for the next attempt.
    in_backoff: i64,
    /// Never failed, waiting behind a failed earlier row of the subject.
    deferred: i64,
    /// Past the cap: left alone until retried or skipped.
    parked: i64,
    /// Abandoned by an operator (kept, never published).
    skipped: i64,
    /// Age of the oldest row in the backlog, in seconds.
    oldest_unpublished_age_secs: Option<f64>,
    /// Rows published in the last hour.
    published_last_hour: i64,
}

impl Counts {
    fn add(&mut self, other: &Counts) {
        self.unpublished += other.unpublished;
        self.fresh += other.fresh;
        self.in_backoff += other.in_backoff;
        self.deferred += other.deferred;
        self.parked += other.parked;
        self.skipped += other.skipped;
        self.published_last_hour += other.published_last_hour;
        self.oldest_unpublished_age_secs = match (
            self.oldest_unpublished_age_secs,
            other.oldest_unpublished_age_secs,
        ) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

#[derive(Debug, Serialize)]
struct TypeCounts {
    event_type: String,
    #[serde(flatten)]
    counts: Counts,
}

#[derive(Debug, Serialize)]
struct Blocked {
    subject: String,
    shard: Option<i16>,
    head_id: Uuid,
    event_type: String,
    attempts: i32,
    last_error: Option<String>,
    created_at: Option<DateTime<Utc>>,
    /// Rows of the subject behind the head, none of which the relay publishes.
    waiting: i64,
}

#[derive(Debug, Serialize)]
struct BlockedSubjects {
    total: i64,
    shown: Vec<Blocked>,
}

#[derive(Debug, Serialize)]
struct Relay {
    pid: i32,
    application_name: Option<String>,
    client_addr: Option<String>,
    backend_start: Option<DateTime<Utc>>,
    state: Option<String>,
    workers: Option<i64>,
    shards: Vec<i32>,
}

#[derive(Debug, Serialize)]
struct Leader {
    consumer: String,
    holder: String,
    epoch: i64,
    acquired_at: Option<DateTime<Utc>>,
    released: bool,
}

/// What `outboxctl status` prints.
#[derive(Debug, Serialize)]
struct Status {
    max_attempts: i32,
    totals: Counts,
    event_types: Vec<TypeCounts>,
    blocked_subjects: BlockedSubjects,
    relays: Vec<Relay>,
    /// Shards (of 64) some relay owns now.
    shards_owned: usize,
    consumer_leaders: Option<Vec<Leader>>,
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let pool = db.connect(&[TABLE]).await?;
    let status = read(&pool, args).await?;
    print(&status, json)
}

async fn read(pool: &PgPool, args: &Args) -> Result<Status> {
    let cap = args.cap.max_attempts;
    let unpublished = sqlx::query_file!("queries/status_types.sql", cap)
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("counting unpublished rows", e))?;
    let published = sqlx::query_file!("queries/status_published.sql")
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("counting rows published in the last hour", e))?;
    let mut types: BTreeMap<String, Counts> = BTreeMap::new();
    for r in unpublished {
        let c = types.entry(r.event_type).or_default();
        c.unpublished = r.unpublished;
        c.fresh = r.fresh;
        c.in_backoff = r.in_backoff;
        c.deferred = r.deferred;
        c.parked = r.parked;
        c.skipped = r.skipped;
        c.oldest_unpublished_age_secs = r.oldest_age_secs.map(|s| s.max(0.0));
    }
    for r in published {
        types.entry(r.event_type).or_default().published_last_hour = r.published;
    }
    let mut totals = Counts::default();
    for c in types.values() {
        totals.add(c);
    }
    let event_types = types
        .into_iter()
        .map(|(event_type, counts)| TypeCounts { event_type, counts })
        .collect();

    // At least one row, so the window's total is there to read.
    let mut blocked = sqlx::query_file!("queries/status_blocked.sql", cap, args.blocked.max(1))
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("finding blocked subjects", e))?;
    let total = blocked.first().map_or(0, |r| r.total);
    blocked.truncate(usize::try_from(args.blocked).unwrap_or(usize::MAX));
    let blocked_subjects = BlockedSubjects {
        total,
        shown: blocked
            .into_iter()
            .map(|r| Blocked {
                subject: r.subject,
                shard: r.shard,
                head_id: r.head_id,
                event_type: r.event_type,
                attempts: r.attempts,
                last_error: r.last_error,
                created_at: r.created_at,
                waiting: r.waiting,
            })
            .collect(),
    };

    // The relays of this outbox only: those of other schemas' outboxes hold
    // locks of their own.
    let namespace = outbox_pg::Namespace::of_table(pool, "outbox_events")
        .await?
        .ok_or_else(|| {
            Error::new(
                ErrorKind::MissingTable,
                "table outbox_events not found through the search_path: run the outbox \
                 migrations first",
            )
        })?;
    let relays: Vec<Relay> = sqlx::query_file!(
        "queries/status_relays.sql",
        namespace.relay_members_key(),
        namespace.relay_shards_key()
    )
    .fetch_all(pool)
    .await
    .map_err(|e| Error::database("reading the relays' locks", e))?
    .into_iter()
    .map(|r| Relay {
        pid: r.pid,
        application_name: r.application_name,
        client_addr: r.client_addr,
        backend_start: r.backend_start,
        state: r.state,
        workers: r.workers,
        shards: r.shards,
    })
    .collect();
    let mut owned: Vec<i32> = relays
        .iter()
        .flat_map(|r| r.shards.iter().copied())
        .collect();
    owned.sort_unstable();
    owned.dedup();

    let consumer_leaders = match sqlx::query_file!("queries/status_leaders.sql")
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("reading inbox_leases", e))
    {
        Ok(rows) => Some(
            rows.into_iter()
                .map(|r| Leader {
                    consumer: r.consumer,
                    holder: r.holder,
                    epoch: r.epoch,
                    acquired_at: r.acquired_at,
                    released: r.released,
                })
                .collect(),
        ),
        Err(e) if e.kind() == ErrorKind::MissingTable => None,
        Err(e) => return Err(e),
    };

    Ok(Status {
        max_attempts: cap,
        totals,
        event_types,
        blocked_subjects,
        relays,
        shards_owned: owned.len(),
        consumer_leaders,
    })
}

fn count_cell(n: i64) -> String {
    if n == 0 {
        "-".to_owned()
    } else {
        n.to_string()
    }
}

fn oldest(c: &Counts) -> String {
    c.oldest_unpublished_age_secs
        .map_or_else(|| "-".to_owned(), age)
}

impl Report for Status {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let t = &self.totals;
        writeln!(
            out,
            "backlog: {} unpublished (oldest {}): {} fresh, {} in backoff, {} deferred, {} parked (cap {}); {} skipped",
            t.unpublished,
            oldest(t),
            t.fresh,
            t.in_backoff,
            t.deferred,
            t.parked,
            self.max_attempts,
            t.skipped
        )?;
        writeln!(out, "published in the last hour: {}", t.published_last_hour)?;
        if !self.event_types.is_empty() {
            writeln!(out)?;
            let mut rows = vec![
                [
                    "event type",
                    "unpublished",
                    "oldest",
                    "backoff",
                    "deferred",
                    "parked",
                    "skipped",
                    "published/1h",
                ]
                .map(String::from)
                .to_vec(),
            ];
            for e in &self.event_types {
                let c = &e.counts;
                rows.push(vec![
                    shown(&e.event_type),
                    count_cell(c.unpublished),
                    oldest(c),
                    count_cell(c.in_backoff),
                    count_cell(c.deferred),
                    count_cell(c.parked),
                    count_cell(c.skipped),
                    count_cell(c.published_last_hour),
                ]);
            }
            table(out, &rows)?;
        }

        writeln!(out)?;
        let b = &self.blocked_subjects;
        if b.total == 0 {
            writeln!(out, "blocked subjects: none")?;
        } else {
            let listed = if (b.shown.len() as i64) < b.total {
                format!(" ({} with the most rows waiting)", b.shown.len())
            } else {
                String::new()
            };
            writeln!(
                out,
                "blocked subjects: {}{listed} — see `outboxctl stuck`, then `retry` or `skip` the head row",
                b.total
            )?;
            let mut rows = vec![
                [
                    "subject",
                    "waiting",
                    "head row",
                    "type",
                    "attempts",
                    "last error",
                ]
                .map(String::from)
                .to_vec(),
            ];
            for s in &b.shown {
                rows.push(vec![
                    shown(&s.subject),
                    s.waiting.to_string(),
                    s.head_id.to_string(),
                    shown(&s.event_type),
                    s.attempts.to_string(),
                    short(s.last_error.as_deref().unwrap_or("-"), 60),
                ]);
            }
            table(out, &rows)?;
        }

        writeln!(out)?;
        if self.relays.is_empty() {
            writeln!(out, "relays: none holds shards in this database")?;
        } else {
            writeln!(
                out,
                "relays: {} ({} of {SHARDS} shards owned)",
                self.relays.len(),
                self.shards_owned
            )?;
            let mut rows = vec![
                [
                    "pid",
                    "application",
                    "client",
                    "since",
                    "state",
                    "workers",
                    "shards",
                ]
                .map(String::from)
                .to_vec(),
            ];
            for r in &self.relays {
                rows.push(vec![
                    r.pid.to_string(),
                    r.application_name.clone().unwrap_or_else(|| "-".into()),
                    r.client_addr.clone().unwrap_or_else(|| "local".into()),
                    when(r.backend_start),
                    r.state.clone().unwrap_or_else(|| "-".into()),
                    r.workers.map_or_else(|| "-".into(), |w| w.to_string()),
                    r.shards.len().to_string(),
                ]);
            }
            table(out, &rows)?;
        }

        if let Some(leaders) = &self.consumer_leaders
            && !leaders.is_empty()
        {
            writeln!(out)?;
            writeln!(out, "ordered consumers' leaders:")?;
            let mut rows = vec![
                ["consumer", "holder", "epoch", "since", "released"]
                    .map(String::from)
                    .to_vec(),
            ];
            for l in leaders {
                rows.push(vec![
                    l.consumer.clone(),
                    l.holder.clone(),
                    l.epoch.to_string(),
                    when(l.acquired_at),
                    if l.released { "yes" } else { "no" }.to_owned(),
                ]);
            }
            table(out, &rows)?;
        }
        Ok(())
    }
}
