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
    let types = event_types(pool, cap).await?;
    let totals = totals(types.values());
    let event_types = types
        .into_iter()
        .map(|(event_type, counts)| TypeCounts { event_type, counts })
        .collect();
    let blocked_subjects = blocked_subjects(pool, cap, args.blocked).await?;
    let relays = relays(pool).await?;
    let shards_owned = shards_owned(&relays);
    let consumer_leaders = consumer_leaders(pool).await?;
    Ok(Status {
        max_attempts: cap,
        totals,
        event_types,
        blocked_subjects,
        relays,
        shards_owned,
        consumer_leaders,
    })
}

/// The counts of each event type: its unpublished rows by state (`cap`
/// parks), and its rows published in the last hour.
async fn event_types(pool: &PgPool, cap: i32) -> Result<BTreeMap<String, Counts>> {
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
    Ok(types)
}

/// The counts of all event types together.
fn totals<'a>(types: impl IntoIterator<Item = &'a Counts>) -> Counts {
    let mut totals = Counts::default();
    for c in types {
        totals.add(c);
    }
    totals
}

/// The blocked subjects (`cap` parks), the `limit` with the most rows
/// waiting listed, and how many there are.
async fn blocked_subjects(pool: &PgPool, cap: i32, limit: i64) -> Result<BlockedSubjects> {
    // At least one row, so the window's total is there to read.
    let mut blocked = sqlx::query_file!("queries/status_blocked.sql", cap, limit.max(1))
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("finding blocked subjects", e))?;
    let total = blocked.first().map_or(0, |r| r.total);
    blocked.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    Ok(BlockedSubjects {
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
    })
}

/// The relays holding shards of this outbox, from `pg_locks`.
async fn relays(pool: &PgPool) -> Result<Vec<Relay>> {
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
    Ok(sqlx::query_file!(
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
    .collect())
}

/// How many distinct shards the relays own between them.
fn shards_owned(relays: &[Relay]) -> usize {
    let mut owned: Vec<i32> = relays
        .iter()
        .flat_map(|r| r.shards.iter().copied())
        .collect();
    owned.sort_unstable();
    owned.dedup();
    owned.len()
}

/// The ordered consumers' leaders, or `None` without an `inbox_leases`
/// table.
async fn consumer_leaders(pool: &PgPool) -> Result<Option<Vec<Leader>>> {
    match sqlx::query_file!("queries/status_leaders.sql")
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("reading inbox_leases", e))
    {
        Ok(rows) => Ok(Some(
            rows.into_iter()
                .map(|r| Leader {
                    consumer: r.consumer,
                    holder: r.holder,
                    epoch: r.epoch,
                    acquired_at: r.acquired_at,
                    released: r.released,
                })
                .collect(),
        )),
        Err(e) if e.kind() == ErrorKind::MissingTable => Ok(None),
        Err(e) => Err(e),
    }
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
        self.write_backlog(out)?;
        writeln!(out)?;
        self.write_blocked(out)?;
        writeln!(out)?;
        self.write_relays(out)?;
        self.write_leaders(out)
    }
}

/// A table's header row.
fn header(titles: &[&str]) -> Vec<String> {
    titles.iter().map(|&t| t.to_owned()).collect()
}

impl Status {
    /// The backlog's totals, the last hour's, and a table of event types.
    fn write_backlog(&self, out: &mut dyn Write) -> std::io::Result<()> {
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
        if self.event_types.is_empty() {
            return Ok(());
        }
        writeln!(out)?;
        let mut rows = vec![header(&[
            "event type",
            "unpublished",
            "oldest",
            "backoff",
            "deferred",
            "parked",
            "skipped",
            "published/1h",
        ])];
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
        table(out, &rows)
    }

    /// How many subjects are blocked, and a table of those listed.
    fn write_blocked(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let b = &self.blocked_subjects;
        if b.total == 0 {
            return writeln!(out, "blocked subjects: none");
        }
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
        let mut rows = vec![header(&[
            "subject",
            "waiting",
            "head row",
            "type",
            "attempts",
            "last error",
        ])];
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
        table(out, &rows)
    }

    /// How many relays hold shards, and a table of them.
    fn write_relays(&self, out: &mut dyn Write) -> std::io::Result<()> {
        if self.relays.is_empty() {
            return writeln!(out, "relays: none holds shards in this database");
        }
        writeln!(
            out,
            "relays: {} ({} of {SHARDS} shards owned)",
            self.relays.len(),
            self.shards_owned
        )?;
        let mut rows = vec![header(&[
            "pid",
            "application",
            "client",
            "since",
            "state",
            "workers",
            "shards",
        ])];
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
        table(out, &rows)
    }

    /// A table of the ordered consumers' leaders, if there are any.
    fn write_leaders(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let Some(leaders) = self.consumer_leaders.as_ref().filter(|l| !l.is_empty()) else {
            return Ok(());
        };
        writeln!(out)?;
        writeln!(out, "ordered consumers' leaders:")?;
        let mut rows = vec![header(&[
            "consumer", "holder", "epoch", "since", "released",
        ])];
        for l in leaders {
            rows.push(vec![
                l.consumer.clone(),
                l.holder.clone(),
                l.epoch.to_string(),
                when(l.acquired_at),
                if l.released { "yes" } else { "no" }.to_owned(),
            ]);
        }
        table(out, &rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relay(shards: &[i32]) -> Relay {
        Relay {
            pid: 1,
            application_name: None,
            client_addr: None,
            backend_start: None,
            state: None,
            workers: None,
            shards: shards.to_vec(),
        }
    }

    #[test]
    fn a_shard_listed_by_two_relays_counts_once() {
        assert_eq!(shards_owned(&[]), 0);
        assert_eq!(shards_owned(&[relay(&[3, 1]), relay(&[1, 2])]), 3);
    }

    #[test]
    fn totals_add_the_counts_and_keep_the_oldest_age() {
        let a = Counts {
            unpublished: 2,
            parked: 1,
            oldest_unpublished_age_secs: Some(5.0),
            ..Counts::default()
        };
        let b = Counts {
            unpublished: 3,
            published_last_hour: 7,
            ..Counts::default()
        };
        let t = totals([&a, &b]);
        assert_eq!((t.unpublished, t.parked, t.published_last_hour), (5, 1, 7));
        assert_eq!(t.oldest_unpublished_age_secs, Some(5.0));
    }

    #[test]
    fn an_empty_outbox_reads_as_such() {
        let status = Status {
            max_attempts: 20,
            totals: Counts::default(),
            event_types: Vec::new(),
            blocked_subjects: BlockedSubjects {
                total: 0,
                shown: Vec::new(),
            },
            relays: Vec::new(),
            shards_owned: 0,
            consumer_leaders: Some(Vec::new()),
        };
        let mut out = Vec::new();
        status.human(&mut out).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "backlog: 0 unpublished (oldest -): 0 fresh, 0 in backoff, 0 deferred, 0 parked \
             (cap 20); 0 skipped\npublished in the last hour: 0\n\nblocked subjects: none\n\n\
             relays: none holds shards in this database\n"
        );
    }
}
