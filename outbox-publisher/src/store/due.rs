//! The due lane's statements: scheduled rows taken when due, the time the
//! next one is, and how many wait.

use futures::TryStreamExt;

use super::{ClaimRecord, ClaimedRow, Store, count};
use crate::error::{Error, Result};

/// What a due-lane claim takes.
#[derive(Debug, Clone)]
pub(crate) struct DueRequest<'a> {
    pub(crate) shards: &'a [i16],
    pub(crate) max_attempts: i32,
    pub(crate) rows: usize,
    pub(crate) byte_budget: usize,
    pub(crate) max_message: usize,
}

impl Store {
    /// Takes the scheduled rows of `req.shards` that are due, in due-time
    /// order (see `queries/due_claim.sql`).
    pub(crate) async fn due_claim(&self, req: &DueRequest<'_>) -> Result<Vec<ClaimedRow>> {
        let failed = |e| Error::database("taking due scheduled outbox rows", e);
        let mut rows = sqlx::query_file_as!(
            ClaimRecord,
            "queries/due_claim.sql",
            req.shards,
            req.max_attempts,
            count(req.rows),
            count(req.byte_budget),
            count(req.max_message),
        )
        .fetch(&self.pool);
        let mut out = Vec::new();
        while let Some(row) = rows.try_next().await.map_err(failed)? {
            out.push(ClaimedRow::decode(row));
        }
        Ok(out)
    }

    /// How long until the due lane of `shards` has a row to publish, by the
    /// database's clock: `None` when nothing is scheduled; zero or less when
    /// a row is due already.
    pub(crate) async fn due_next(&self, shards: &[i16], max_attempts: i32) -> Result<Option<f64>> {
        sqlx::query_file!("queries/due_next.sql", shards, max_attempts)
            .fetch_one(&self.pool)
            .await
            .map(|r| r.in_secs)
            .map_err(|e| Error::database("reading the next due time", e))
    }

    /// Scheduled rows not due yet (see `queries/stats_scheduled.sql`).
    pub(crate) async fn scheduled_count(&self) -> Result<i64> {
        sqlx::query_file!("queries/stats_scheduled.sql")
            .fetch_one(&self.pool)
            .await
            .map(|r| r.scheduled)
            .map_err(|e| Error::database("counting scheduled rows", e))
    }
}
