//! `outboxctl status`: what is waiting in the outbox and why, at a glance.
//!
//! One set of queries that stays cheap on a big table: the counts read only
//! unpublished rows (partial indexes on `published_at is null`: the backlog,
//! the scheduled rows and the cancelled ones kept), the last hour only that
//! range of `outbox_events_published_idx`, blocked subjects only the retry
//! lane; relays come from `pg_locks`.
//!
//! `--json` prints one object:
//!
//! ```text
//! { "max_attempts": 20,
//!   "totals": { "unpublished", "fresh", "due", "in_backoff", "deferred", "parked", "skipped",
//!               "scheduled", "next_due_at", "next_due_in_secs" (null when none scheduled),
//!               "cancelled", "oldest_unpublished_age_secs" (null when none),
//!               "published_last_hour" },
//!   "event_types": [ { "event_type", …the same fields… } ],
//!   "blocked_subjects": { "total", "shown": [ { "subject", "shard", "head_id", "event_type",
//!                          "attempts", "last_error", "created_at", "waiting" } ] },
//!   "relays": [ { "pid", "application_name", "client_addr", "backend_start", "state",
//!                 "workers", "shards": [..] } ],
//!   "shards_owned": n,
//!   "consumer_leaders": [ { "consumer", "holder", "epoch", "acquired_at", "released" } ] }
//! ```
//!
//! `unpublished` is the backlog: every row to be published now or after a
//! failure, `fresh + due + in_backoff + deferred + parked`; its oldest age
//! counts from a row's insert, or a scheduled row's due time. Apart from it:
//! `scheduled` (scheduled rows waiting for their time, never backlog however
//! many; `next_due_at` the earliest due time among them), `cancelled`
//! (scheduled rows cancelled, kept as the record until retention) and
//! `skipped`. `due` counts scheduled rows fallen due and never failed
//! (claimable now by the relay's due lane); one that fell due and failed is
//! `in_backoff` or `parked` like any row. Blocked subjects are those of
//! immediate rows: a scheduled row blocks nothing. `consumer_leaders` is null
//! when the database has no `inbox_leases` table.

mod counts;

use std::io::Write;

use chrono::{DateTime, Utc};
use outbox_pg::SHARDS;
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use self::counts::{Counts, TypeCounts, event_types, totals};
use super::{Cap, TABLE, short, shown};
use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::when;
use crate::output::{Report, print, table};

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

impl Report for Status {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        counts::write(out, &self.totals, &self.event_types, self.max_attempts)?;
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
            "backlog: 0 unpublished (oldest -): 0 fresh, 0 due, 0 in backoff, 0 deferred, \
             0 parked (cap 20); 0 skipped\nscheduled: 0 not yet due; 0 cancelled (kept as the \
             record until retention)\npublished in the last hour: 0\n\nblocked subjects: none\n\n\
             relays: none holds shards in this database\n"
        );
    }
}
