//! Every statement the relay sends to Postgres. The SQL lives in `queries/`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use crate::error::{Error, Result};

const CLAIM: &str = include_str!("../queries/claim.sql");
const MARK_PUBLISHED: &str = include_str!("../queries/mark_published.sql");
const MARK_FAILED: &str = include_str!("../queries/mark_failed.sql");
const RELEASE: &str = include_str!("../queries/release.sql");
const STATS: &str = include_str!("../queries/stats.sql");
const PRUNE: &str = include_str!("../queries/prune.sql");
const VACUUM: &str = include_str!("../queries/vacuum.sql");

/// A row claimed for publishing, in created_at order.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct ClaimedRow {
    pub(crate) id: Uuid,
    pub(crate) event_type: String,
    pub(crate) source: String,
    pub(crate) subject: String,
    pub(crate) time: DateTime<Utc>,
    pub(crate) data: serde_json::Value,
    pub(crate) created_at: DateTime<Utc>,
    pub(crate) attempts: i32,
    pub(crate) traceparent: Option<String>,
    pub(crate) tracestate: Option<String>,
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

#[derive(Debug, Clone)]
pub(crate) struct Store {
    pool: PgPool,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Store {
    pub(crate) fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Claims up to `limit` rows (see `queries/claim.sql`), leased for `lease`.
    pub(crate) async fn claim(
        &self,
        limit: usize,
        max_attempts: i32,
        lease: Duration,
        blocked_deferral: Duration,
    ) -> Result<Vec<ClaimedRow>> {
        sqlx::query_as(CLAIM)
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(max_attempts)
            .bind(millis(lease))
            .bind(millis(blocked_deferral))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| Error::database("claiming outbox rows", e))
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

    pub(crate) async fn release(&self, ids: &[Uuid]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        sqlx::query(RELEASE)
            .bind(ids)
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|e| Error::database("releasing claimed rows", e))
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

    /// Vacuums `outbox_events` (outside any transaction).
    pub(crate) async fn vacuum(&self) -> Result<()> {
        sqlx::raw_sql(VACUUM)
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|e| Error::database("vacuuming outbox_events", e))
    }
}
