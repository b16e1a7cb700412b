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

/// Fewest rows a due-lane claim reads from one shard.
const MIN_PER_SHARD: usize = 64;

/// Rows a due-lane claim reads from each of `shards` shards for a batch of
/// `rows`: four times an even share, at least [`MIN_PER_SHARD`], so a burst
/// spread over the shards fills the batch from a few rows of each instead of
/// reading a batch from every shard; a burst in a few shards takes a few
/// claims more.
fn per_shard(rows: usize, shards: usize) -> usize {
    rows.div_ceil(shards.max(1))
        .saturating_mul(4)
        .clamp(MIN_PER_SHARD.min(rows), rows.max(1))
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
            count(per_shard(req.rows, req.shards.len())),
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

#[cfg(test)]
mod tests {
    use super::per_shard;

    #[test]
    fn a_claim_reads_a_few_rows_of_each_shard_never_more_than_the_batch() {
        assert_eq!(per_shard(1000, 64), 64);
        assert_eq!(per_shard(1000, 32), 128);
        assert_eq!(per_shard(1000, 1), 1000);
        assert_eq!(per_shard(10, 64), 10);
        assert_eq!(per_shard(1, 0), 1);
    }
}
