//! One batch of the polling source: claim from the checked-out shards,
//! publish and record through the [`Engine`](super::Engine), move the
//! cursors.
//!
//! Every row read ends the batch published, failed, deferred or unresolved
//! (see the engine). For an unresolved row nothing is written; the shard's
//! cursor stops before it, so the next batch reads it again.

use std::collections::HashMap;
use std::time::Instant;

use tracing::debug;

use super::PollSource;
use crate::error::Result;
use crate::metrics;
use crate::relay::BatchReport;
use crate::relay::shards::Checkout;
use crate::sink::Sink;
use crate::store::{ClaimRequest, ClaimedRow};

/// Rows a claim may read from one shard, whatever the batch is split over.
const MIN_PER_SHARD: usize = 16;

/// Rows a claim reads from each checked-out shard, in `had_rows`' order.
///
/// The batch is shared by the shards that had rows at their last read; the
/// others are read a few rows deep ([`MIN_PER_SHARD`]), enough to notice new
/// rows. So a backlog left in a few shards (the end of a drain, a few busy
/// entities) is still read in full batches.
fn claim_limits(had_rows: &[bool], batch_size: usize) -> Vec<i32> {
    let busy = had_rows.iter().filter(|&&b| b).count().max(1);
    let idle = batch_size.min(MIN_PER_SHARD);
    let per_busy = batch_size.div_ceil(busy).max(idle);
    had_rows
        .iter()
        .map(|&b| i32::try_from(if b { per_busy } else { idle }).unwrap_or(i32::MAX))
        .collect()
}

/// Main-lane rows read per shard, and the highest `seq` read.
fn main_lane_reads(rows: &[ClaimedRow]) -> HashMap<i16, (usize, i64)> {
    let mut read: HashMap<i16, (usize, i64)> = HashMap::new();
    for row in rows.iter().filter(|r| !r.retry) {
        let e = read.entry(row.shard).or_insert((0, 0));
        e.0 += 1;
        e.1 = e.1.max(row.seq);
    }
    read
}

/// Where each of `shards`' cursors moves after a batch: up to `settled`, not
/// past the last main-lane row read when the shard read its whole limit (it
/// may have more), never past an unresolved main-lane row (the next batch
/// reads it again).
fn cursor_moves(
    shards: &[i16],
    limits: &[i32],
    settled: i64,
    read: &HashMap<i16, (usize, i64)>,
    unresolved: &[ClaimedRow],
) -> Vec<i64> {
    let mut stop: HashMap<i16, i64> = HashMap::new();
    for row in unresolved.iter().filter(|r| !r.retry) {
        let e = stop.entry(row.shard).or_insert(i64::MAX);
        *e = (*e).min(row.seq - 1);
    }
    shards
        .iter()
        .zip(limits)
        .map(|(shard, &limit)| {
            let mut to = settled;
            let limit = usize::try_from(limit).unwrap_or(usize::MAX);
            if let Some(&(n, last)) = read.get(shard)
                && n >= limit
            {
                to = to.min(last);
            }
            if let Some(&s) = stop.get(shard) {
                to = to.min(s);
            }
            to
        })
        .collect()
}

/// Whether a claim read its shards to their end: each shard fewer main-lane
/// rows than its limit, the retry lane fewer than its own, and nothing left
/// unresolved (over the byte budget, behind a broker fault). Rows committed
/// after it are another NOTIFY's.
fn read_to_end(
    shards: &[i16],
    limits: &[i32],
    read: &HashMap<i16, (usize, i64)>,
    retried: usize,
    retry_limit: usize,
    unresolved: &[ClaimedRow],
) -> bool {
    unresolved.is_empty()
        && retried < retry_limit
        && shards.iter().zip(limits).all(|(shard, &limit)| {
            read.get(shard)
                .is_none_or(|&(n, _)| n < usize::try_from(limit).unwrap_or(usize::MAX))
        })
}

/// What a batch did, and whether it read its part of the shards to its end.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Ran {
    pub(super) report: BatchReport,
    pub(super) to_end: bool,
}

impl<S: Sink> PollSource<'_, S> {
    /// Claims from `checkout`'s shards, publishes, marks, and advances cursors.
    pub(super) async fn run_batch(&self, checkout: &Checkout<'_>) -> Result<Ran> {
        // Settled before the claim's snapshot is taken: safe to move cursors
        // to, within the same epoch (read first).
        let epoch = self.horizon.epoch();
        // Beside a WAL source, the main lane stops where the WAL begins;
        // cursors never pass it, so rows above it stay readable here if the
        // WAL source hands them back (a lost slot).
        let main_until = self.lane.until();
        let settled = self.horizon.settled().min(main_until);
        let cursors = checkout.cursors(epoch);
        let limits = claim_limits(&checkout.had_rows(), self.engine.config.batch_size);
        let max_payload = self.engine.sink.max_payload();
        let started = Instant::now();
        let rows = self
            .engine
            .store
            .claim(&ClaimRequest {
                shards: checkout.ids(),
                cursors: &cursors,
                limits: &limits,
                retry_limit: self.engine.config.batch_size,
                max_attempts: self.engine.config.max_attempts,
                byte_budget: self.engine.config.batch_bytes,
                max_message: max_payload,
                main_until,
            })
            .await?;
        metrics::phase("claim", started.elapsed());
        if rows.is_empty() {
            for &shard in checkout.ids() {
                checkout.advance(shard, settled, epoch);
                checkout.set_had_rows(shard, false);
            }
            self.tick_horizon().await?;
            return Ok(Ran {
                report: BatchReport::default(),
                to_end: true,
            });
        }
        metrics::batch(rows.len());
        let claimed_at = Instant::now();
        let deadline = claimed_at
            + self
                .engine
                .config
                .lease
                .saturating_sub(self.engine.config.publish_timeout);
        let mut report = BatchReport {
            claimed: rows.len(),
            ..BatchReport::default()
        };
        let read = main_lane_reads(&rows);
        let retried = rows.iter().filter(|r| r.retry).count();
        let unresolved = self
            .engine
            .publish_rows(rows, deadline, max_payload, &mut report)
            .await?;
        let to_end = read_to_end(
            checkout.ids(),
            &limits,
            &read,
            retried,
            self.engine.config.batch_size,
            &unresolved,
        );
        let moves = cursor_moves(checkout.ids(), &limits, settled, &read, &unresolved);
        for (&shard, to) in checkout.ids().iter().zip(moves) {
            checkout.set_had_rows(shard, read.contains_key(&shard));
            checkout.advance(shard, to, epoch);
        }
        self.tick_horizon().await?;
        debug!(?report, to_end, settled, cursors = ?cursors.iter().take(3).collect::<Vec<_>>(), took = ?claimed_at.elapsed(), "batch done");
        Ok(Ran { report, to_end })
    }

    /// Moves the settled horizon on for the next batch, off the path from a
    /// wake-up to its claim.
    async fn tick_horizon(&self) -> Result<()> {
        let started = Instant::now();
        self.horizon.tick(&self.engine.store).await?;
        metrics::phase("horizon", started.elapsed());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(shard: i16, seq: i64, retry: bool) -> ClaimedRow {
        ClaimedRow {
            shard,
            seq,
            retry,
            ..ClaimedRow::sample()
        }
    }

    #[test]
    fn the_batch_is_shared_by_the_shards_that_had_rows() {
        // Two busy shards share 100; the idle ones look 16 rows deep.
        assert_eq!(
            claim_limits(&[true, false, true, false], 100),
            [50, 16, 50, 16]
        );
        // None busy: each looks 16 rows deep.
        assert_eq!(claim_limits(&[false, false], 100), [16, 16]);
        // A busy shard never reads fewer than an idle one.
        assert_eq!(claim_limits(&[true; 10], 100), [16; 10]);
        // A batch smaller than the idle depth bounds both.
        assert_eq!(claim_limits(&[true, false], 8), [8, 8]);
    }

    #[test]
    fn cursors_stop_at_the_settled_horizon_a_full_read_and_an_unresolved_row() {
        let rows = [
            row(1, 10, false),
            row(1, 12, false),
            row(2, 20, false),
            row(2, 25, false),
            row(3, 5, true), // the retry lane moves no cursor
        ];
        let read = main_lane_reads(&rows);
        assert_eq!(read[&1], (2, 12));
        assert_eq!(read[&2], (2, 25));
        assert!(!read.contains_key(&3));
        let shards = [1, 2, 3, 4];
        // Shard 1 read its whole limit (2): it may have more past seq 12.
        // Shard 2 read less than its limit, but seq 20 is unresolved.
        // Shards 3 and 4 go to the settled horizon.
        let limits = [2, 16, 16, 16];
        let unresolved = [row(2, 20, false), row(3, 4, true)];
        assert_eq!(
            cursor_moves(&shards, &limits, 100, &read, &unresolved),
            [12, 19, 100, 100]
        );
        // Nothing unresolved and nothing full: all to the horizon.
        assert_eq!(
            cursor_moves(&shards, &[16; 4], 30, &read, &[]),
            [30, 30, 30, 30]
        );
    }

    #[test]
    fn a_claim_reads_its_part_to_the_end_when_no_limit_is_reached_and_nothing_is_left() {
        let rows = [row(1, 10, false), row(1, 12, false), row(3, 5, true)];
        let read = main_lane_reads(&rows);
        let shards = [1, 2];
        // Shard 1 read 2 of 16, shard 2 nothing, the retry lane 1 of 100.
        assert!(read_to_end(&shards, &[16, 16], &read, 1, 100, &[]));
        // Shard 1 read its whole limit: it may have more.
        assert!(!read_to_end(&shards, &[2, 16], &read, 1, 100, &[]));
        // The retry lane read its whole limit.
        assert!(!read_to_end(&shards, &[16, 16], &read, 100, 100, &[]));
        // A row left unresolved is read again.
        assert!(!read_to_end(
            &shards,
            &[16, 16],
            &read,
            1,
            100,
            &[row(1, 12, false)]
        ));
    }
}
