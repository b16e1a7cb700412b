//! Every statement the relay sends to Postgres. The SQL lives in `queries/`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::error::{Error, Result};

const CLAIM: &str = include_str!("../queries/claim.sql");
const MARK_PUBLISHED: &str = include_str!("../queries/mark_published.sql");
const MARK_FAILED: &str = include_str!("../queries/mark_failed.sql");
const DEFER: &str = include_str!("../queries/defer.sql");
const WAKE_FOLLOWERS: &str = include_str!("../queries/wake_followers.sql");
const HORIZON: &str = include_str!("../queries/horizon.sql");
const SHARDS_STATE: &str = include_str!("../queries/shards_state.sql");
const SHARDS_ACQUIRE: &str = include_str!("../queries/shards_acquire.sql");
const SHARDS_JOIN: &str = include_str!("../queries/shards_join.sql");
const SHARDS_RELEASE: &str = include_str!("../queries/shards_release.sql");
const STATS: &str = include_str!("../queries/stats.sql");
const PRUNE: &str = include_str!("../queries/prune.sql");

/// A row read by a claim, in seq order. Every column a writer can fill with
/// something no client decodes arrives as `None` or as a decode error kept on
/// the row, never as a failed claim.
#[derive(Debug, Clone)]
pub(crate) struct ClaimedRow {
    pub(crate) id: Uuid,
    pub(crate) seq: i64,
    pub(crate) shard: i16,
    /// Read from the retry lane (it failed before, or waited behind a failure).
    pub(crate) retry: bool,
    pub(crate) event_type: String,
    pub(crate) source: String,
    pub(crate) subject: String,
    /// `None`: infinite or outside years 1–9999.
    pub(crate) time: Option<DateTime<Utc>>,
    pub(crate) created_at: Option<DateTime<Utc>>,
    pub(crate) attempts: i32,
    pub(crate) traceparent: Option<String>,
    pub(crate) tracestate: Option<String>,
    /// The payload's JSON text; `None` when over the largest message or past
    /// the batch's byte budget.
    pub(crate) data: Option<String>,
    pub(crate) data_len: i64,
    /// Past the batch's byte budget: left for the next batch, untouched.
    pub(crate) over_budget: bool,
    /// An earlier row of the subject waits in the retry lane.
    pub(crate) blocker: Option<Blocker>,
    /// A column could not be decoded (the row is parked with this error).
    pub(crate) decode_error: Option<String>,
}

/// The earlier row of its subject that holds a claimed row back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Blocker {
    /// Parked past the attempt cap: wait for an operator.
    Parked,
    /// In backoff until this time.
    Until(DateTime<Utc>),
    /// Due now but not in this batch: try again next batch.
    DueNow,
}

impl ClaimedRow {
    fn decode(row: &PgRow) -> std::result::Result<Self, sqlx::Error> {
        let id: Uuid = row.try_get("id")?;
        let seq: i64 = row.try_get("seq")?;
        let shard: i16 = row.try_get("shard")?;
        let retry: bool = row.try_get("retry")?;
        let blocked: bool = row.try_get("blocked")?;
        let mut out = Self {
            id,
            seq,
            shard,
            retry,
            event_type: String::new(),
            source: String::new(),
            subject: String::new(),
            time: None,
            created_at: None,
            attempts: 0,
            traceparent: None,
            tracestate: None,
            data: None,
            data_len: 0,
            over_budget: false,
            blocker: None,
            decode_error: None,
        };
        // Whatever fails to decode from here on parks this row only.
        if let Err(e) = out.decode_rest(row, blocked) {
            out.decode_error = Some(e.to_string());
        }
        Ok(out)
    }

    fn decode_rest(&mut self, row: &PgRow, blocked: bool) -> std::result::Result<(), sqlx::Error> {
        self.subject = row.try_get("subject")?;
        self.attempts = row.try_get("attempts")?;
        self.over_budget = row.try_get("over_budget")?;
        if blocked {
            let parked: bool = row.try_get("blocker_parked")?;
            let due_now: bool = row.try_get("blocker_due_now")?;
            let due: Option<DateTime<Utc>> = row.try_get("blocker_due")?;
            self.blocker = Some(match (parked, due_now, due) {
                (true, _, _) | (false, false, None) => Blocker::Parked,
                (false, true, _) => Blocker::DueNow,
                (false, false, Some(t)) => Blocker::Until(t),
            });
        }
        self.event_type = row.try_get("event_type")?;
        self.source = row.try_get("source")?;
        self.time = row.try_get("time")?;
        self.created_at = row.try_get("created_at")?;
        self.traceparent = row.try_get("traceparent")?;
        self.tracestate = row.try_get("tracestate")?;
        self.data_len = row.try_get("data_len")?;
        self.data = row.try_get("data")?;
        Ok(())
    }
}

/// What a claim reads.
#[derive(Debug, Clone)]
pub(crate) struct ClaimRequest<'a> {
    pub(crate) shards: &'a [i16],
    pub(crate) cursors: &'a [i64],
    /// Rows to read per shard, in `shards` order.
    pub(crate) limits: &'a [i32],
    /// Rows to read from the retry lane.
    pub(crate) retry_limit: usize,
    pub(crate) max_attempts: i32,
    pub(crate) byte_budget: usize,
    pub(crate) max_message: usize,
}

/// A failed publish, to be recorded on its row.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) id: Uuid,
    pub(crate) error: String,
    pub(crate) retry_in: Duration,
    pub(crate) permanent: bool,
}

/// A row whose failure took it to the attempt cap.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct CappedRow {
    pub(crate) id: Uuid,
    pub(crate) subject: String,
    pub(crate) event_type: String,
    pub(crate) attempts: i32,
    pub(crate) last_error: Option<String>,
}

/// Backlog figures for the gauges.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
pub(crate) struct Stats {
    pub(crate) backlog: i64,
    pub(crate) past_cap: i64,
    pub(crate) oldest_age_secs: f64,
}

/// One tick of the settled-seq horizon.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct Tick {
    pub(crate) last_seq: i64,
    pub(crate) snapshot: String,
    pub(crate) settled: bool,
}

/// The lock table's view of the relays and their shards.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct ShardsState {
    /// Workers of every live relay, this one included.
    pub(crate) workers: i64,
    /// Shards held by other relays.
    pub(crate) taken: Vec<i32>,
}

#[derive(Debug, Clone)]
pub(crate) struct Store {
    pool: PgPool,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn count(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Store {
    /// A store on connections of its own, opened with `pool`'s connect
    /// options and JIT off: the claim's plan is estimated expensive on a large
    /// table (a lateral per shard), which crosses `jit_above_cost`, and
    /// compiling it took far longer (~0.8 s on 300k rows) than running it (a
    /// few ms). `connections` bounds the pool.
    pub(crate) fn new(pool: &PgPool, connections: u32) -> Self {
        let options = (*pool.connect_options()).clone().options([("jit", "off")]);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(pool.options().get_acquire_timeout())
            .connect_lazy_with(options);
        Self { pool }
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Reads a batch (see `queries/claim.sql`).
    pub(crate) async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Vec<ClaimedRow>> {
        let failed = |e| Error::database("claiming outbox rows", e);
        let mut rows = sqlx::query(CLAIM)
            .bind(req.shards)
            .bind(req.cursors)
            .bind(req.limits)
            .bind(req.max_attempts)
            .bind(count(req.byte_budget))
            .bind(count(req.max_message))
            .bind(count(req.retry_limit))
            .fetch(&self.pool);
        let mut out = Vec::new();
        while let Some(row) = rows.try_next().await.map_err(failed)? {
            out.push(
                ClaimedRow::decode(&row)
                    .map_err(|e| Error::database("decoding a claimed outbox row", e))?,
            );
        }
        Ok(out)
    }

    pub(crate) async fn mark_published(&self, ids: &[Uuid]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        sqlx::query(MARK_PUBLISHED)
            .bind(ids)
            .execute(&self.pool)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| Error::database("marking rows published", e))
    }

    /// Records failures; returns the rows that reached the cap.
    pub(crate) async fn mark_failed(
        &self,
        failures: &[Failure],
        max_attempts: i32,
    ) -> Result<Vec<CappedRow>> {
        if failures.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
        let delays: Vec<i64> = failures.iter().map(|f| millis(f.retry_in)).collect();
        let permanent: Vec<bool> = failures.iter().map(|f| f.permanent).collect();
        let rows: Vec<CappedRow> = sqlx::query_as(MARK_FAILED)
            .bind(&ids)
            .bind(&errors)
            .bind(&delays)
            .bind(&permanent)
            .bind(max_attempts)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("recording publish failures", e))?;
        Ok(rows
            .into_iter()
            .filter(|r| r.attempts >= max_attempts)
            .collect())
    }

    /// Moves rows held back by an earlier failed row of their subject to the
    /// retry lane: due at `due`, or after `parked_deferral` when it is `None`.
    pub(crate) async fn defer(
        &self,
        rows: &[(Uuid, Option<DateTime<Utc>>)],
        parked_deferral: Duration,
    ) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
        let due: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.1).collect();
        sqlx::query(DEFER)
            .bind(&ids)
            .bind(&due)
            .bind(millis(parked_deferral))
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|e| Error::database("deferring rows behind a failed row", e))
    }

    /// Makes rows deferred behind a now-published row of `subjects` due.
    pub(crate) async fn wake_followers(&self, subjects: &[&str]) -> Result<()> {
        if subjects.is_empty() {
            return Ok(());
        }
        sqlx::query(WAKE_FOLLOWERS)
            .bind(subjects)
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|e| Error::database("releasing rows deferred behind a published row", e))
    }

    /// One horizon tick, settling `previous` (a snapshot an earlier tick returned).
    pub(crate) async fn tick(&self, previous: Option<&str>) -> Result<Tick> {
        sqlx::query_as(HORIZON)
            .bind(previous)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| Error::database("reading the outbox sequence horizon", e))
    }

    pub(crate) async fn shards_state(
        conn: &mut PgConnection,
        members_ns: i32,
        shards_ns: i32,
    ) -> Result<ShardsState> {
        sqlx::query_as(SHARDS_STATE)
            .bind(i64::from(members_ns))
            .bind(i64::from(shards_ns))
            .fetch_one(conn)
            .await
            .map_err(|e| Error::database("reading shard ownership", e))
    }

    /// Tries to take `shards`; returns those taken.
    pub(crate) async fn acquire_shards(
        conn: &mut PgConnection,
        shards_ns: i32,
        shards: &[i32],
    ) -> Result<Vec<i16>> {
        sqlx::query_scalar(SHARDS_ACQUIRE)
            .bind(shards_ns)
            .bind(shards)
            .fetch_all(conn)
            .await
            .map_err(|e| Error::database("taking shards", e))
    }

    /// Registers this relay's session as a member with `workers` workers.
    pub(crate) async fn join_shards(
        conn: &mut PgConnection,
        members_ns: i32,
        workers: i32,
        lease: Duration,
    ) -> Result<()> {
        sqlx::query(SHARDS_JOIN)
            .bind(members_ns)
            .bind(workers)
            .bind(millis(lease))
            .execute(conn)
            .await
            .map(drop)
            .map_err(|e| Error::database("joining the relays' shard ownership", e))
    }

    /// Gives up `shards`.
    pub(crate) async fn release_shards(
        conn: &mut PgConnection,
        shards_ns: i32,
        shards: &[i32],
    ) -> Result<()> {
        sqlx::query(SHARDS_RELEASE)
            .bind(shards_ns)
            .bind(shards)
            .execute(conn)
            .await
            .map(drop)
            .map_err(|e| Error::database("giving up shards", e))
    }

    pub(crate) async fn stats(&self, max_attempts: i32) -> Result<Stats> {
        sqlx::query_as(STATS)
            .bind(max_attempts)
            .fetch_one(&self.pool)
            .await
            .map_err(|e| Error::database("reading backlog", e))
    }

    /// Deletes one batch of published rows older than `window`; returns how many.
    pub(crate) async fn prune(&self, window: Duration, batch: i64) -> Result<u64> {
        sqlx::query(PRUNE)
            .bind(millis(window))
            .bind(batch)
            .execute(&self.pool)
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| Error::database("pruning published rows", e))
    }
}
