//! The relay's audit task: every `audit_interval`, the rows of the shards
//! this relay owns that were published within the audit horizon and longer
//! ago than the stream's duplicate window (plus a margin) are read back from
//! the stream by their PubAck's sequence and checked (see
//! [`crate::audit`]). A lost one is made unpublished again, in the retry
//! lane, and the relay's workers publish it again with the same id.
//!
//! Replicas split the work as they split the shards. Each shard is read from
//! a keyset mark (`published_at`, `id`) past the last row checked, so a row is
//! checked once per relay start; a shard taken over starts at the horizon. A
//! pass checks at most `audit_rows` rows on a connection of its own, so it
//! never holds up a batch; a pass that reached that budget is followed by the
//! next one after a pause as long as the pass took (at least 50 ms) instead
//! of the interval, so the audit keeps up with a relay publishing more than
//! `audit_rows` per interval while taking at most half the time of its
//! connection and reads, and backs off with a slow broker (the lag gauge,
//! `outbox_relay_audit_lag_seconds`, shows it falling behind; rows that leave the
//! horizon unchecked are not audited). A pass that fails (the broker not reachable, a
//! timeout, a database error) judges nothing and moves no mark: the same rows
//! are checked at the next pass.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::shards::Shards;
use crate::audit::{Audit, Marks};
use crate::config::RelayConfig;
use crate::error::Result;

/// Rows read from the table per page of a pass.
const PAGE: usize = 256;

/// The shortest pause after a pass that reached its row budget: the pause
/// is as long as the pass took (at least this, at most the interval), so an
/// audit behind the rows published catches up at no more than half the time
/// of its connection and its reads, and backs off with a slow broker.
const BEHIND_PAUSE: Duration = Duration::from_millis(50);

/// The audit task of a relay: its audit, config, and the shards it owns.
#[derive(Debug)]
pub(super) struct Auditor<'a> {
    pub(super) audit: Option<&'a Audit>,
    pub(super) config: &'a RelayConfig,
    pub(super) shards: &'a Shards,
}

impl Auditor<'_> {
    /// Audit passes until `shutdown` (none with the audit off).
    pub(super) async fn run(&self, shutdown: &CancellationToken) {
        let (Some(audit), Some(horizon)) = (self.audit, self.config.audit_horizon) else {
            return;
        };
        crate::metrics::register_audit();
        let mut marks = Marks::default();
        let mut failing = false;
        while !shutdown.is_cancelled() {
            let started = Instant::now();
            let pass = self.audit_pass(audit, horizon, &mut marks);
            let result = tokio::select! {
                () = shutdown.cancelled() => break,
                result = pass => result,
            };
            let mut pause = self.config.audit_interval;
            match result {
                Ok((checked, lost)) => {
                    if failing {
                        info!(stream = audit.stream(), "audit passes again");
                        failing = false;
                    }
                    debug!(checked, lost, "audit pass done");
                    // At its budget: more rows wait, so the next pass comes
                    // sooner (each still bounded).
                    if checked >= self.config.audit_rows as u64 {
                        pause = pause.min(started.elapsed().max(BEHIND_PAUSE));
                    }
                }
                Err(e) => {
                    if !failing {
                        warn!(stream = audit.stream(), error = %e, "audit pass failed; nothing judged, retrying at the next interval");
                        failing = true;
                    } else {
                        debug!(error = %e, "audit pass failed again");
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = shutdown.cancelled() => {}
            }
        }
    }

    /// One pass over the owned shards; returns rows checked and found lost.
    async fn audit_pass(
        &self,
        audit: &Audit,
        horizon: Duration,
        marks: &mut Marks,
    ) -> Result<(u64, u64)> {
        // Ages by the database's clock, which set `published_at`.
        let now = audit.now().await?;
        let until = audit.settled_before(now);
        let from = chrono::Duration::from_std(horizon)
            .ok()
            .and_then(|h| now.checked_sub_signed(h))
            .unwrap_or(until);
        let owned = self.shards.owned();
        let mut marks_now = marks.for_shards(&owned, from);
        let (mut checked, mut lost) = (0_u64, 0_u64);
        let started = Instant::now();
        while from < until && checked < self.config.audit_rows as u64 && !marks_now.is_empty() {
            let page = PAGE.min(self.config.audit_rows - checked as usize).max(1);
            let rows = audit
                .rows(&marks_now, until, i64::try_from(page).unwrap_or(i64::MAX))
                .await?;
            let full = rows.len() >= page;
            let last = rows.last().map(|r| (r.published_at, r.id));
            let shards: Vec<i16> = marks_now.iter().map(|m| m.0).collect();
            for row in audit.check(rows).await? {
                checked += 1;
                crate::metrics::audit_checked();
                if audit.republish(&row).await? {
                    lost += 1;
                }
            }
            match last {
                Some(to) if full => {
                    marks.advance(&shards, to);
                    marks_now = marks.for_shards(&owned, from);
                }
                _ => {
                    // Every row up to `until` is checked.
                    marks.advance(&shards, (until, uuid::Uuid::max()));
                    break;
                }
            }
        }
        if let Some(oldest) = marks.oldest() {
            let lag = (now - oldest).to_std().unwrap_or_default();
            crate::metrics::audit_lag(lag.as_secs_f64());
        }
        debug!(checked, lost, took = ?started.elapsed(), "audit pass");
        Ok((checked, lost))
    }
}
