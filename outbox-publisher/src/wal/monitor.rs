//! What the WAL source watches beside its pipeline: the slot's gauges, and
//! rows it has read and confirmed that are still fresh afterwards.
//!
//! # Rows left behind
//!
//! Above the floor only the WAL source publishes fresh rows, and it reads
//! only inserts. So a fresh row it never gets, or gets and fails to record,
//! would wait there for ever while the relay looks healthy. Two ways make
//! one: a row made fresh again by plain SQL (`update … set next_attempt_at =
//! null` on a parked row: an update, which the WAL source does not read;
//! `outboxctl retry` puts rows in the retry lane instead), and a fault of the
//! relay itself. Every [`PROBE_EVERY`] the monitor takes, per shard, the
//! oldest fresh row above the floor (and at or below the settled horizon:
//! above it, rows of running transactions would be visited one by one), with
//! the WAL insert position at that moment
//! (`queries/wal_fresh_probe.sql`): every commit of those rows precedes that
//! position. Once the slot's confirmed position (as the server reports it)
//! passes it, the WAL source has published and recorded every one of them;
//! any still fresh then was left behind. The relay then says so (a warning
//! naming the rows, `outbox_relay_wal_stranded_total`, the
//! `OutboxRelayWalStranded` alert), ends the session, and backfills: the
//! polling path publishes every fresh row up to the highest seq handed out,
//! in order, before the WAL is read again, exactly as after a lost slot.
//!
//! No row waiting for its turn is taken for one left behind: while the
//! pipeline holds a row, the slot is not confirmed past its commit. The
//! probe's per-shard start moves up behind it, never past a row that is still
//! fresh or past the settled horizon (a transaction still running may commit
//! a lower seq), so each probe reads a short index range.

use std::time::{Duration, Instant};

use tracing::warn;
use uuid::Uuid;

use super::slot;
use super::source::WalReader;
use crate::error::Result;
use crate::metrics;
use crate::relay::SHARDS;
use crate::relay::message;
use crate::sink::Sink;

/// Rows named in the warning about rows left behind.
const NAMED: usize = 5;
/// Consecutive failed looks for rows left behind before the relay says so.
const FAILED_LOOKS: u32 = 3;
/// How often the fresh rows above the floor are looked at (the slot's gauges
/// are set every stats interval).
const PROBE_EVERY: Duration = Duration::from_secs(15);

/// Rows seen fresh by a probe, and the WAL position their commits precede.
#[derive(Debug)]
struct Suspects {
    ids: Vec<Uuid>,
    lsn: i64,
}

/// The probe's state: where each shard's look starts, and the rows waiting to
/// be checked once the slot has passed them.
#[derive(Debug)]
struct Probe {
    shards: Vec<i16>,
    after: Vec<i64>,
    suspects: Option<Suspects>,
    /// When the last probe ran.
    probed: Option<Instant>,
}

impl Probe {
    fn new(floor: i64) -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|s| i16::try_from(s).unwrap_or(i16::MAX))
                .collect(),
            after: vec![floor; SHARDS],
            suspects: None,
            probed: None,
        }
    }

    /// Moves each shard's start up to just below its oldest fresh row found
    /// (`found`, as shard and seq), or to `settled` where none was, never
    /// back and never past `settled`.
    fn advance(&mut self, found: &[(i16, i64)], settled: i64) {
        let mut to = vec![settled; SHARDS];
        for &(shard, seq) in found {
            if let Some(t) = usize::try_from(shard).ok().and_then(|s| to.get_mut(s)) {
                *t = (*t).min(seq - 1);
            }
        }
        for (after, to) in self.after.iter_mut().zip(to) {
            *after = (*after).max(to);
        }
    }
}

impl<S: Sink> WalReader<'_, S> {
    /// Sets the slot's gauges every stats interval and looks for rows left
    /// behind above `floor`. Returns how many it found, once it finds some;
    /// never returns otherwise.
    pub(super) async fn monitor(&self, floor: i64) -> usize {
        let pool = self.engine.store.pool();
        let (slot_name, schema) = (self.names.slot.as_str(), self.names.schema.as_str());
        let mut probe = Probe::new(floor);
        // Consecutive failed looks; said once they reach FAILED_LOOKS (a
        // database outage alone ends the session sooner).
        let mut failed = 0u32;
        loop {
            let confirmed = match slot::state(pool, slot_name).await {
                Ok(Some(state)) => {
                    let at_risk =
                        matches!(state.wal_status.as_deref(), Some("unreserved" | "lost"));
                    metrics::wal_slot(state.lag_bytes, at_risk);
                    state.confirmed
                }
                _ => None,
            };
            let found = match self.check(&mut probe, confirmed).await {
                Ok(found) => {
                    failed = 0;
                    found
                }
                Err(e) => {
                    failed = failed.saturating_add(1);
                    if failed == FAILED_LOOKS {
                        warn!(error = %e, looks = failed, "cannot look for rows the WAL source left behind; trying again at every stats interval");
                    }
                    None
                }
            };
            if let Some(found) = found {
                warn!(
                    rows = found.len(),
                    ids = %found.iter().take(NAMED).map(Uuid::to_string).collect::<Vec<_>>().join(", "),
                    schema = %message::for_log(schema),
                    "rows read from the WAL and confirmed are still unpublished (made fresh again by \
                     plain SQL, or a fault of the relay): publishing every fresh row through the \
                     polling path, then reading the WAL again"
                );
                metrics::wal_stranded(found.len());
                return found.len();
            }
            tokio::time::sleep(
                self.engine
                    .config
                    .stats_interval
                    .max(Duration::from_millis(100)),
            )
            .await;
        }
    }

    /// One look: checks the rows of the last probe once the slot's
    /// `confirmed` position has passed them (returns those still fresh, if
    /// any), else probes again.
    ///
    /// # Errors
    /// [`ErrorKind::Database`](crate::ErrorKind::Database): the look is
    /// tried again at the next stats interval.
    async fn check(&self, probe: &mut Probe, confirmed: Option<i64>) -> Result<Option<Vec<Uuid>>> {
        let pool = self.engine.store.pool();
        if let Some(suspects) = &probe.suspects {
            if confirmed.is_none_or(|c| c < suspects.lsn) {
                return Ok(None);
            }
            let left = slot::still_fresh(pool, &suspects.ids).await?;
            if !left.is_empty() {
                return Ok(Some(left));
            }
            probe.suspects = None;
        }
        if probe.probed.is_some_and(|t| t.elapsed() < PROBE_EVERY) {
            return Ok(None);
        }
        probe.probed = Some(Instant::now());
        // Read before the probe's snapshot: no row at or below it can be
        // committed later.
        let settled = self.horizon.settled();
        let (found, lsn) = slot::fresh_probe(pool, &probe.shards, &probe.after, settled).await?;
        let seqs: Vec<(i16, i64)> = found.iter().map(|f| (f.shard, f.seq)).collect();
        probe.advance(&seqs, settled);
        probe.suspects = lsn.map(|lsn| Suspects {
            ids: found.iter().map(|f| f.id).collect(),
            lsn,
        });
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_start_stays_below_its_oldest_fresh_row_and_the_horizon() {
        let mut probe = Probe::new(100);
        // Shard 0 has a fresh row at 150, shard 1 at 300; the horizon is 200.
        probe.advance(&[(0, 150), (1, 300)], 200);
        assert_eq!(probe.after[0], 149);
        assert_eq!(probe.after[1], 200);
        assert_eq!(probe.after[2], 200);
        // Never back: a later look with a lower horizon leaves them.
        probe.advance(&[(0, 120)], 110);
        assert_eq!(probe.after[0], 149);
        assert_eq!(probe.after[2], 200);
        // Never below the floor.
        let mut probe = Probe::new(100);
        probe.advance(&[(3, 50)], 40);
        assert!(probe.after.iter().all(|&a| a == 100));
    }
}
