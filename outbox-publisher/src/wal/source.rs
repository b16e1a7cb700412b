//! The WAL source as a task beside the polling source: leadership of the
//! slot, the backfill through the polling path, and replication sessions,
//! each reading the stream into a [`Pipeline`] (read → publish → mark →
//! confirm) with the [`monitor`](super::monitor) beside it. It publishes
//! through the relay's engine, owns its own progress from one session to the
//! next, and shares with the polling source only two handles: the
//! [`MainLaneLimit`] it raises to hand rows to the polling workers, and the
//! wake-up channel that tells them to look. The design is in [`crate::wal`].

use std::time::{Duration, Instant};

use pgwire_replication::ReplicationClient;
use sqlx::{Connection, PgConnection};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::backfill::Record;
use super::pipeline::{Pipeline, Progress};
use super::wal_error;
use super::{WalSource, slot};
use crate::backoff::LoopBackoff;
use crate::error::{Error, ErrorKind, Result};
use crate::metrics;
use crate::relay::{Engine, Horizon, MainLaneLimit};
use crate::sink::Sink;
use crate::store::Store;

/// How often the leader checks that its session (and so its lock) lives,
/// and a standby tries to take the lead.
const LEAD_CHECK: Duration = Duration::from_secs(1);
/// How long the backfill waits between looks at what is left.
const BACKFILL_RECHECK: Duration = Duration::from_millis(100);

/// Waits for the lead of the WAL source's slot: a session holding its
/// advisory lock. `None` when `shutdown` came first.
///
/// # Errors
/// [`ErrorKind::Config`] for a slot name no retry makes valid.
pub(crate) async fn lead(
    store: &Store,
    wal: &WalSource,
    shutdown: &CancellationToken,
) -> Result<Option<(PgConnection, slot::Names)>> {
    let options = (*store.pool().connect_options()).clone();
    let mut said = false;
    let mut retry = LoopBackoff::new(LEAD_CHECK, Duration::from_secs(10));
    loop {
        let attempt = async {
            let names = slot::names(store.pool(), wal.slot.as_deref()).await?;
            let mut conn = PgConnection::connect_with(&options)
                .await
                .map_err(|e| Error::database("connecting for the WAL source's lead", e))?;
            let led = slot::try_lead(&mut conn, &names.slot).await?;
            Ok::<_, Error>(led.then_some((conn, names.clone())).ok_or(names))
        };
        let pause = match tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            r = attempt => r,
        } {
            Ok(Ok(lead)) => {
                info!(slot = %lead.1.slot, "leading the WAL source");
                return Ok(Some(lead));
            }
            Ok(Err(names)) => {
                if !said {
                    info!(slot = %names.slot, "another relay leads the WAL source; standing by");
                    said = true;
                }
                retry.reset();
                LEAD_CHECK
            }
            Err(e) if e.kind() == ErrorKind::Config => return Err(e),
            Err(e) => {
                if !said {
                    warn!(error = %e, "cannot take the lead of the WAL source yet; retrying");
                    said = true;
                }
                retry.next()
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = tokio::time::sleep(pause) => {}
        }
    }
}

/// Watches the leader's session, pinging it within `timeout`; cancels
/// `stop` when it is gone (the lock with it). Returns when `stop` is
/// cancelled.
pub(crate) async fn keep_lead(
    conn: &mut PgConnection,
    timeout: Duration,
    stop: &CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(LEAD_CHECK) => {}
        }
        let alive = tokio::time::timeout(timeout, conn.ping()).await;
        if !matches!(alive, Ok(Ok(()))) {
            warn!("the WAL source's lead session ended; stopping to stand by again");
            stop.cancel();
            return;
        }
    }
}

/// The WAL source of a relay that leads its slot (see the module docs).
#[derive(Debug)]
pub(crate) struct WalReader<'a, S> {
    pub(super) engine: &'a Engine<S>,
    pub(super) horizon: &'a Horizon,
    source: &'a WalSource,
    pub(super) names: slot::Names,
    /// Hands the polling source's main lane the rows up to the floor.
    limit: MainLaneLimit,
    /// Whether the slot's backfill was done, beyond this process.
    record: Record,
}

impl<'a, S: Sink> WalReader<'a, S> {
    /// The WAL source reading `names`' slot, handing rows at or below its
    /// floor to the polling source through `limit`.
    pub(crate) fn new(
        engine: &'a Engine<S>,
        horizon: &'a Horizon,
        source: &'a WalSource,
        names: slot::Names,
        limit: MainLaneLimit,
    ) -> Self {
        Self {
            engine,
            horizon,
            source,
            names,
            limit,
            record: Record::default(),
        }
    }

    /// Reads the WAL until `stop`, session after session; `wake` tells the
    /// polling workers when rows were handed to them.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] / [`ErrorKind::Privilege`] from the start-up
    /// checks, which no retry passes.
    pub(crate) async fn run(
        &self,
        wake: &watch::Sender<u64>,
        stop: &CancellationToken,
    ) -> Result<()> {
        metrics::wal_registered();
        let mut progress = Progress::default();
        let mut retry = LoopBackoff::new(Duration::from_millis(500), Duration::from_secs(10));
        while !stop.is_cancelled() {
            let result = self.session(wake, stop, &mut progress).await;
            metrics::wal_up(false);
            match result {
                Ok(()) => retry.reset(),
                Err(e) if matches!(e.kind(), ErrorKind::Config | ErrorKind::Privilege) => {
                    return Err(e);
                }
                Err(e) => {
                    if !progress.failing {
                        warn!(error = %e, "WAL source interrupted; reading again from the slot's confirmed position");
                        progress.failing = true;
                    }
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = tokio::time::sleep(retry.next()) => {}
                    }
                }
            }
        }
        Ok(())
    }

    /// One replication session: checks, slot, backfill unless the slot's
    /// is recorded, then reading (catching up first with the WAL written
    /// before the session, see [`super::backfill`]).
    async fn session(
        &self,
        wake: &watch::Sender<u64>,
        stop: &CancellationToken,
        p: &mut Progress,
    ) -> Result<()> {
        self.prepare_slot(p).await?;
        let pool = self.engine.store.pool();
        let slot = self.names.slot.as_str();
        let floor = match p.floor {
            Some(floor) => floor,
            None => match self.recorded(p).await? {
                Some(floor) => floor,
                None => match self.backfill(wake, stop).await? {
                    Some(floor) => {
                        self.record.done(pool, slot, floor).await?;
                        p.must_backfill = false;
                        floor
                    }
                    None => return Ok(()),
                },
            },
        };
        p.floor = Some(floor);
        // Rows in transactions that end before this position may have their
        // outcome already (the session or relay before): checked first.
        let written = slot::insert_lsn(pool).await?;
        let config = self.source.replication_config(slot);
        let mut client = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            c = ReplicationClient::connect(config) => c.map_err(|e| wal_error("connecting for replication", &e))?,
        };
        metrics::wal_up(true);
        if p.failing {
            info!(slot = %self.names.slot, "WAL source reading again");
            p.failing = false;
        }
        let result = self.read(&mut client, floor, written, stop, p).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), client.shutdown()).await;
        result
    }

    /// Checks the slot and the publication, and makes the slot (again) when
    /// it is missing or lost; then `p`'s floor is gone, so the session
    /// backfills first.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] for a slot of another plugin or database, and
    /// the checks' errors.
    async fn prepare_slot(&self, p: &mut Progress) -> Result<()> {
        let (wal, names) = (self.source, &self.names);
        let pool = self.engine.store.pool();
        slot::check(pool, &names.slot).await?;
        slot::ensure_publication(pool, names).await?;
        let existing = slot::state(pool, &names.slot).await?;
        if let Some(state) = &existing {
            let database = wal.database.as_str();
            if state.plugin.as_deref() != Some("pgoutput")
                || state.database.as_deref() != Some(database)
            {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!(
                        "replication slot `{}` exists for plugin {:?} in database {:?}, not pgoutput in `{database}`: \
                         name another with --wal-slot, or drop it",
                        names.slot, state.plugin, state.database
                    ),
                ));
            }
        }
        let lost = existing.as_ref().is_some_and(slot::SlotState::is_lost);
        if existing.is_none() || lost {
            if lost || p.floor.is_some() {
                warn!(
                    slot = %names.slot,
                    wal_status = existing.as_ref().and_then(|s| s.wal_status.as_deref()).unwrap_or("missing"),
                    "the replication slot is gone (dropped, invalidated, or not on this server after a failover): \
                     publishing the rows not yet marked through the polling path and making it again"
                );
                metrics::wal_slot_lost();
            }
            if lost {
                slot::drop_slot(pool, &names.slot).await?;
            }
            // A record must never speak of the slot made now.
            self.record.forget(pool, &names.slot).await?;
            if slot::create(pool, &names.slot).await? {
                info!(slot = %names.slot, "created the replication slot (pgoutput)");
            }
            p.floor = None;
            p.must_backfill = true;
        }
        Ok(())
    }

    /// The floor of the slot's recorded backfill, unless this relay must
    /// backfill (it made the slot, or found rows left behind).
    async fn recorded(&self, p: &Progress) -> Result<Option<i64>> {
        if p.must_backfill {
            return Ok(None);
        }
        let floor = self
            .record
            .floor(self.engine.store.pool(), &self.names.slot)
            .await?;
        if let Some(floor) = floor {
            info!(
                slot = %self.names.slot,
                up_to_seq = floor,
                "the slot's backfill is done: catching up from its confirmed position; reading the WAL"
            );
        }
        Ok(floor)
    }

    /// Reads the stream from above `floor` through the pipeline, with the
    /// monitor beside it, until `stop`.
    async fn read(
        &self,
        client: &mut ReplicationClient,
        floor: i64,
        written: u64,
        stop: &CancellationToken,
        p: &mut Progress,
    ) -> Result<()> {
        // The session ends with `stop`, or when the monitor finds rows left
        // behind: then the pipeline stops as at `stop`, and the next session
        // backfills them first.
        let session = stop.child_token();
        let mut stranded = 0;
        let result = {
            let pipeline = Pipeline::new(self.engine, &session, p.done).run(
                client,
                &self.names.schema,
                (floor, written),
                p,
            );
            let monitor = self.monitor(floor);
            tokio::pin!(pipeline, monitor);
            loop {
                tokio::select! {
                    r = &mut pipeline => break r,
                    n = &mut monitor, if stranded == 0 => {
                        stranded = n;
                        session.cancel();
                    }
                }
            }
        };
        if stranded > 0 {
            p.floor = None;
            p.must_backfill = true;
            // So that no other relay catches up past them either.
            if let Err(e) = self
                .record
                .forget(self.engine.store.pool(), &self.names.slot)
                .await
            {
                warn!(error = %e, "could not forget the slot's backfill; the next session backfills anyway");
            }
        }
        result
    }

    /// Lets the polling workers publish every fresh row up to the highest
    /// seq handed out now, and waits until none is left and no transaction
    /// can still commit one (the horizon passed it). The seq it returns is
    /// the WAL reader's floor. `None` when `stop` came first.
    async fn backfill(
        &self,
        wake: &watch::Sender<u64>,
        stop: &CancellationToken,
    ) -> Result<Option<i64>> {
        let floor = self.engine.store.tick(None).await?.last_seq;
        self.limit.raise(floor);
        wake.send_modify(|n| *n = n.wrapping_add(1));
        let started = Instant::now();
        loop {
            if self.horizon.settled() >= floor
                && !slot::main_left(self.engine.store.pool(), floor).await?
            {
                info!(
                    up_to_seq = floor,
                    took = ?started.elapsed(),
                    "rows written before the slot published through the polling path; reading the WAL"
                );
                return Ok(Some(floor));
            }
            tokio::select! {
                () = stop.cancelled() => return Ok(None),
                () = tokio::time::sleep(BACKFILL_RECHECK) => {}
            }
        }
    }
}
