//! Shard ownership: which relay publishes which entities.
//!
//! Rows carry `shard`, a hash of their subject into [`SHARDS`] buckets (a
//! generated column). Each shard is owned by one relay at a time through a
//! PostgreSQL session advisory lock, held on a connection of its own: a relay
//! that dies, or whose session the server closes, lets go of its shards at
//! once. Every relay also holds a shared "member" lock whose key carries its
//! worker count, so each one reads from `pg_locks` how many workers are alive
//! and takes its share, `ceil(SHARDS × own workers / all workers)`: it takes
//! free shards while under its share and gives back (after the batch in hand)
//! shards above it. A shard's owner reads and publishes its rows alone, so no
//! claim has to look at rows other relays hold, and replicas never contend for
//! the same rows.
//!
//! The locks' first keys are those of the outbox's schema
//! ([`outbox_pg::Namespace`]): relays of outboxes in other schemas of the same
//! database hold locks of their own and never see these.
//!
//! The lock session sets `idle_session_timeout` to the lease, and the relay
//! confirms it every 500 ms; a relay frozen (or cut off) for
//! longer than the lease loses its session and with it its shards, and its
//! workers stop claiming once the last confirmation is older than half the
//! lease. A deposed owner can still finish publishing the batch in hand
//! (bounded by the lease) while the new owner starts; both publish each
//! subject as a gap-free prefix in seq order, so the stream still stores each
//! subject in order, and the stream's duplicate window (checked at start-up to
//! exceed lease + publish timeout) drops the repeats.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgConnection};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::LoopBackoff;
use crate::error::Result;
use crate::store::Store;

/// Shards rows are spread over (the migration's `& 63`): [`outbox_pg::SHARDS`].
pub use outbox_pg::SHARDS;
/// How often ownership is confirmed and rebalanced.
pub(crate) const REBALANCE_INTERVAL: Duration = Duration::from_millis(500);
/// Takes of free shards in one rebalance: after the first, each reads
/// ownership again and takes what is still free, in place of the shards
/// another relay took meanwhile.
const TAKE_ROUNDS: usize = 4;
/// Every owned shard is read from its start again this often, to pick up
/// rows an operator put back in the main lane below the cursor.
const SWEEP_INTERVAL: Duration = Duration::from_secs(60);

#[derive(Debug)]
struct Slot {
    owned: AtomicBool,
    busy: AtomicBool,
    /// Every main-lane row of the shard at or below this seq is resolved.
    cursor: AtomicI64,
    /// The horizon epoch the cursor belongs to.
    epoch: AtomicU64,
    swept: Mutex<Option<Instant>>,
    /// Whether its main lane had rows at the last read: shards that had share
    /// the batch's rows, the others get a few, enough to notice new rows.
    had_rows: AtomicBool,
}

/// The shards this relay owns and the session that holds them.
#[derive(Debug)]
pub(crate) struct Shards {
    slots: Vec<Slot>,
    workers: usize,
    lease: Duration,
    options: SessionOptions,
    confirmed: Mutex<Option<Instant>>,
    next: AtomicUsize,
    /// Bumped whenever the owned set changes (and once ownership is first settled).
    changed: watch::Sender<u64>,
    /// The lock keys of the outbox's schema, found when the session first joins.
    keys: OnceLock<Keys>,
    /// Why this relay cannot own shards here at all (its sessions lead to a
    /// transaction pooler); set once, and the relay stops.
    failure: Mutex<Option<crate::Error>>,
    failed: CancellationToken,
}

/// First keys of the member and shard locks (see [`outbox_pg::Namespace`]).
#[derive(Debug, Clone, Copy)]
struct Keys {
    members: i32,
    shards: i32,
}

/// The shard session's connect options. Its `Debug` names the server and the
/// role only: sqlx's derived one prints the password, and a `Relay` is
/// `Debug`.
struct SessionOptions(PgConnectOptions);

impl std::fmt::Debug for SessionOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgConnectOptions")
            .field("host", &self.0.get_host())
            .field("port", &self.0.get_port())
            .field("database", &self.0.get_database())
            .field("username", &self.0.get_username())
            .finish_non_exhaustive()
    }
}

/// Shards checked out by one worker; handed back on drop.
#[derive(Debug)]
pub(crate) struct Checkout<'a> {
    shards: &'a Shards,
    ids: Vec<i16>,
}

impl Checkout<'_> {
    pub(crate) fn ids(&self) -> &[i16] {
        &self.ids
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Cursors of the checked-out shards, in `ids` order. A shard not swept
    /// for [`SWEEP_INTERVAL`], or whose cursor belongs to an older horizon
    /// `epoch`, is read from its start.
    pub(crate) fn cursors(&self, epoch: u64) -> Vec<i64> {
        self.ids
            .iter()
            .map(|&id| {
                let slot = self.shards.slot(id);
                let mut swept = slot.swept.lock().unwrap_or_else(|e| e.into_inner());
                if slot.epoch.swap(epoch, Ordering::AcqRel) != epoch
                    || swept.is_none_or(|t| t.elapsed() >= SWEEP_INTERVAL)
                {
                    *swept = Some(Instant::now());
                    slot.cursor.store(0, Ordering::Release);
                }
                slot.cursor.load(Ordering::Acquire)
            })
            .collect()
    }

    /// Whether each checked-out shard had main-lane rows at its last read, in
    /// `ids` order.
    pub(crate) fn had_rows(&self) -> Vec<bool> {
        self.ids
            .iter()
            .map(|&id| self.shards.slot(id).had_rows.load(Ordering::Acquire))
            .collect()
    }

    /// Records whether a shard's main lane had rows at this read.
    pub(crate) fn set_had_rows(&self, id: i16, had: bool) {
        self.shards.slot(id).had_rows.store(had, Ordering::Release);
    }

    /// Moves a shard's cursor forward to `seq` (never back), unless the
    /// cursor has moved to another horizon `epoch` since the batch began.
    pub(crate) fn advance(&self, id: i16, seq: i64, epoch: u64) {
        let slot = self.shards.slot(id);
        // The slot's lock orders this against `cursors` resetting it.
        let _swept = slot.swept.lock().unwrap_or_else(|e| e.into_inner());
        if slot.epoch.load(Ordering::Acquire) == epoch {
            slot.cursor.fetch_max(seq, Ordering::AcqRel);
        }
    }
}

impl Drop for Checkout<'_> {
    fn drop(&mut self) {
        for &id in &self.ids {
            self.shards.slot(id).busy.store(false, Ordering::Release);
        }
    }
}

impl Shards {
    pub(crate) fn new(options: PgConnectOptions, workers: usize, lease: Duration) -> Self {
        Self {
            slots: (0..SHARDS)
                .map(|_| Slot {
                    owned: AtomicBool::new(false),
                    busy: AtomicBool::new(false),
                    cursor: AtomicI64::new(0),
                    epoch: AtomicU64::new(0),
                    swept: Mutex::new(None),
                    had_rows: AtomicBool::new(true),
                })
                .collect(),
            workers,
            lease,
            options: SessionOptions(options),
            confirmed: Mutex::new(None),
            next: AtomicUsize::new(0),
            changed: watch::channel(0).0,
            keys: OnceLock::new(),
            failure: Mutex::new(None),
            failed: CancellationToken::new(),
        }
    }

    /// Completes when a session found this relay cannot own shards here.
    pub(crate) async fn failed(&self) {
        self.failed.cancelled().await;
    }

    /// Why this relay cannot own shards here, if it found so.
    pub(crate) fn take_failure(&self) -> Option<crate::Error> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn slot(&self, id: i16) -> &Slot {
        &self.slots[usize::try_from(id).unwrap_or(0) % SHARDS]
    }

    /// Shards owned now.
    pub(crate) fn owned(&self) -> Vec<i16> {
        (0..SHARDS)
            .filter(|&i| self.slots[i].owned.load(Ordering::Acquire))
            .filter_map(|i| i16::try_from(i).ok())
            .collect()
    }

    /// Whether ownership was confirmed recently enough to publish.
    fn is_confirmed(&self) -> bool {
        self.confirmed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|t| t.elapsed() < self.lease / 2)
    }

    /// Forgets earlier ownership changes, so a waiter sees the next
    /// [`Shards::maintain`] settle ownership.
    pub(crate) fn reset_changes(&self) {
        self.changed.send_replace(0);
    }

    /// Notified when the owned set changes.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Checks out a part of the owned shards that no other worker has: about
    /// `owned / parts`, starting at a rotating offset.
    pub(crate) fn checkout(&self, parts: usize) -> Checkout<'_> {
        let mut ids = Vec::new();
        if self.is_confirmed() {
            let owned = self.owned();
            let share = owned.len().div_ceil(parts.max(1));
            let start = self.next.fetch_add(share.max(1), Ordering::Relaxed);
            for k in 0..owned.len() {
                if ids.len() >= share {
                    break;
                }
                let id = owned[(start + k) % owned.len()];
                let slot = self.slot(id);
                if slot.owned.load(Ordering::Acquire)
                    && slot
                        .busy
                        .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    ids.push(id);
                }
            }
        }
        Checkout { shards: self, ids }
    }

    fn set_owned(&self, id: i16, owned: bool) {
        let slot = self.slot(id);
        if owned {
            slot.cursor.store(0, Ordering::Release);
            slot.had_rows.store(true, Ordering::Release);
            *slot.swept.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        }
        slot.owned.store(owned, Ordering::Release);
    }

    fn lose_all(&self) {
        for slot in &self.slots {
            slot.owned.store(false, Ordering::Release);
        }
        *self.confirmed.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.changed.send_modify(|n| *n += 1);
    }

    /// Keeps this relay's share of shards until `shutdown`, then gives them
    /// all back (after the batches in hand).
    pub(crate) async fn maintain(&self, shutdown: &CancellationToken) {
        let mut conn: Option<PgConnection> = None;
        let mut retry = LoopBackoff::new(Duration::from_millis(200), Duration::from_secs(5));
        let mut healthy = true;
        while !shutdown.is_cancelled() {
            let result = match conn.as_mut() {
                Some(c) => self.rebalance(c).await,
                None => match self.join().await {
                    Ok(c) => {
                        conn = Some(c);
                        // Let replicas starting together register before
                        // anyone takes shards.
                        tokio::select! {
                            () = tokio::time::sleep(REBALANCE_INTERVAL / 2) => {}
                            () = shutdown.cancelled() => {}
                        }
                        continue;
                    }
                    Err(e) => Err(e),
                },
            };
            let pause = match result {
                Ok(()) => {
                    retry.reset();
                    if !healthy {
                        info!("shard ownership session restored");
                        healthy = true;
                    }
                    REBALANCE_INTERVAL
                }
                Err(e) if e.kind() == crate::ErrorKind::Config => {
                    // Not an outage: this relay cannot hold shards here.
                    *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    self.lose_all();
                    self.failed.cancel();
                    break;
                }
                Err(e) => {
                    if healthy {
                        warn!(error = %e, "shard ownership session lost; this relay stops publishing until it is back");
                        healthy = false;
                    }
                    conn = None;
                    self.lose_all();
                    retry.next()
                }
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = shutdown.cancelled() => {}
            }
        }
        // Shutdown: stop handing out shards, wait for the batches in hand
        // (bounded by the lease), then let go.
        let owned = self.owned();
        for &id in &owned {
            self.slot(id).owned.store(false, Ordering::Release);
        }
        self.wait_idle(&owned).await;
        if let (Some(mut c), Some(keys)) = (conn, self.keys.get()) {
            let ids: Vec<i32> = owned.iter().map(|&i| i32::from(i)).collect();
            if let Err(e) = Store::release_shards(&mut c, keys.shards, &ids).await {
                debug!(error = %e, "releasing shards at shutdown");
            }
        }
    }

    async fn join(&self) -> Result<PgConnection> {
        // A session lock taken through a transaction pooler would stay on a
        // server session other clients use: never take one there.
        outbox_pg::require_sessions(&self.options.0, "the relay").await?;
        let mut conn = self
            .options
            .0
            .clone()
            .application_name("outbox-relay shards")
            .connect()
            .await
            .map_err(|e| crate::Error::database("connecting the shard ownership session", e))?;
        let keys = match self.keys.get() {
            Some(keys) => *keys,
            None => {
                let namespace = outbox_pg::Namespace::of_table(&mut conn, "outbox_events")
                    .await?
                    .ok_or_else(|| {
                        crate::Error::new(
                            crate::ErrorKind::Config,
                            "table outbox_events not found through the search_path; run the \
                             outbox migrations first (outbox_pg::migrate)",
                        )
                    })?;
                debug!(
                    schema = namespace.schema(),
                    "shard locks of the outbox's schema"
                );
                *self.keys.get_or_init(|| Keys {
                    members: namespace.relay_members_key(),
                    shards: namespace.relay_shards_key(),
                })
            }
        };
        let workers = i32::try_from(self.workers).unwrap_or(i32::MAX);
        Store::join_shards(&mut conn, keys.members, workers, self.lease).await?;
        Ok(conn)
    }

    /// The lock keys, once a session has joined.
    fn keys(&self) -> Result<Keys> {
        self.keys.get().copied().ok_or_else(|| {
            crate::Error::new(
                crate::ErrorKind::Database,
                "the shard session has not joined yet",
            )
        })
    }

    async fn rebalance(&self, conn: &mut PgConnection) -> Result<()> {
        let keys = self.keys()?;
        let state = Store::shards_state(conn, keys.members, keys.shards).await?;
        *self.confirmed.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        let all_workers = usize::try_from(state.workers.max(1)).unwrap_or(1);
        let target = (SHARDS * self.workers).div_ceil(all_workers.max(self.workers));
        let owned = self.owned();
        let mut changed = false;
        if owned.len() < target {
            let taken = self.take_free(conn, keys, &state.taken, target).await?;
            changed |= taken > 0;
            debug!(taken, target, "took shards");
        } else if owned.len() > target {
            let excess: Vec<i16> = owned[target..].to_vec();
            for &id in &excess {
                self.set_owned(id, false);
            }
            self.wait_idle(&excess).await;
            let ids: Vec<i32> = excess.iter().map(|&i| i32::from(i)).collect();
            Store::release_shards(conn, keys.shards, &ids).await?;
            changed = true;
            debug!(released = excess.len(), target, "gave back shards");
        }
        if changed || *self.changed.borrow() == 0 {
            self.changed.send_modify(|n| *n += 1);
        }
        Ok(())
    }

    /// Takes free shards (neither held by `others` nor owned here) at random
    /// until this relay owns `target`; returns how many it took. When another
    /// relay took some of them between the read of `others` and this take
    /// (replicas starting together pick at the same moment), ownership is
    /// read again and the shards still free are taken at once, up to
    /// [`TAKE_ROUNDS`] times, rather than a rebalance later: that left a few
    /// shards unowned, their rows waiting, for half a second.
    async fn take_free(
        &self,
        conn: &mut PgConnection,
        keys: Keys,
        others: &[i32],
        target: usize,
    ) -> Result<usize> {
        let mut others = others.to_vec();
        let mut took = 0;
        for round in 0..TAKE_ROUNDS {
            if round > 0 {
                others = Store::shards_state(conn, keys.members, keys.shards)
                    .await?
                    .taken;
            }
            let owned = self.owned();
            let mut free = free_shards(&others, &owned);
            free.shuffle(&mut rand::rng());
            free.truncate(target.saturating_sub(owned.len()));
            if free.is_empty() {
                break;
            }
            let taken = Store::acquire_shards(conn, keys.shards, &free).await?;
            for &id in &taken {
                self.set_owned(id, true);
            }
            took += taken.len();
            if taken.len() == free.len() {
                break;
            }
        }
        Ok(took)
    }

    /// Waits until no worker has any of `ids` checked out (at most the lease).
    async fn wait_idle(&self, ids: &[i16]) {
        let deadline = Instant::now() + self.lease;
        while ids
            .iter()
            .any(|&id| self.slot(id).busy.load(Ordering::Acquire))
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// The shards neither held by other relays (`others`) nor owned here.
fn free_shards(others: &[i32], owned: &[i16]) -> Vec<i32> {
    (0..SHARDS)
        .filter_map(|i| i32::try_from(i).ok())
        .filter(|i| !others.contains(i))
        .filter(|&i| !owned.iter().any(|&o| i32::from(o) == i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_shards_leave_out_those_held_elsewhere_or_owned() {
        assert_eq!(free_shards(&[], &[]).len(), SHARDS);
        let free = free_shards(&[0, 1, 2, 63], &[3, 4]);
        assert_eq!(free.len(), SHARDS - 6);
        assert!(free.iter().all(|i| (5..63).contains(i)));
    }

    #[test]
    fn debug_names_the_server_and_not_the_password() {
        let options = PgConnectOptions::new()
            .host("db")
            .username("relay")
            .password("Zq7,Wm3#xK9");
        let shown = format!("{:?}", Shards::new(options, 1, Duration::from_secs(30)));
        assert!(!shown.contains("Zq7"), "{shown}");
        assert!(
            shown.contains("\"relay\"") && shown.contains("\"db\""),
            "{shown}"
        );
    }
}
