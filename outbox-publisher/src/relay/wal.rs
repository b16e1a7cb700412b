//! The WAL source inside the relay: leadership of the slot, the backfill
//! through the polling path, and the read → publish → mark → confirm loop.
//! The design is in [`crate::wal`].

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::FutureExt;
use pgwire_replication::{Lsn, PgWireError, ReplicationClient, ReplicationEvent};
use sqlx::{Connection, PgConnection};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{BatchReport, Relay};
use crate::backoff::LoopBackoff;
use crate::error::{Error, ErrorKind, Result};
use crate::metrics;
use crate::sink::Sink;
use crate::store::ClaimedRow;
use crate::wal::pgoutput::{self, Message};
use crate::wal::row::{Inserted, Layout};
use crate::wal::{WalSource, slot};

/// How often the leader checks that its session (and so its lock) lives,
/// and a standby tries to take the lead.
const LEAD_CHECK: Duration = Duration::from_secs(1);
/// How long the backfill waits between looks at what is left.
const BACKFILL_RECHECK: Duration = Duration::from_millis(100);
/// A window of rows read from the WAL holds up to this many batches
/// (`batch_size` rows, `batch_bytes` of payloads, each): every window ends
/// with a wait for its last PubAcks, which fewer, larger windows pay less often.
const WINDOW_BATCHES: usize = 4;

/// What the WAL task keeps from one replication session to the next.
#[derive(Debug, Default)]
struct Progress {
    /// Rows at or below it belong to the polling path (the backfill);
    /// `None`: the next session backfills first.
    floor: Option<i64>,
    /// Every transaction ending at or before it is published and recorded.
    done: Lsn,
    /// A session failed and was not followed by a good one yet.
    failing: bool,
}

/// Microseconds between the Unix epoch and PostgreSQL's (2000-01-01).
const PG_EPOCH_MICROS: i64 = 946_684_800_000_000;

impl<S: Sink> Relay<S> {
    /// Waits for the lead of the WAL source's slot: a session holding its
    /// advisory lock. `None` when `shutdown` came first.
    pub(super) async fn wal_lead(
        &self,
        wal: &WalSource,
        shutdown: &CancellationToken,
    ) -> Result<Option<(PgConnection, slot::Names)>> {
        let options = (*self.store.pool().connect_options()).clone();
        let mut said = false;
        let mut retry = LoopBackoff::new(LEAD_CHECK, Duration::from_secs(10));
        loop {
            let attempt = async {
                let names = slot::names(self.store.pool(), wal.slot.as_deref()).await?;
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

    /// Watches the leader's session; cancels `stop` when it is gone (the lock
    /// with it). Returns when `stop` is cancelled.
    pub(super) async fn wal_keep_lead(&self, conn: &mut PgConnection, stop: &CancellationToken) {
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(LEAD_CHECK) => {}
            }
            let alive = tokio::time::timeout(self.config.publish_timeout, conn.ping()).await;
            if !matches!(alive, Ok(Ok(()))) {
                warn!("the WAL source's lead session ended; stopping to stand by again");
                stop.cancel();
                return;
            }
        }
    }

    /// Reads the WAL until `stop`, session after session.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] / [`ErrorKind::Privilege`] from the start-up
    /// checks, which no retry passes.
    pub(super) async fn wal_loop(
        &self,
        wal: &WalSource,
        names: slot::Names,
        wake: &watch::Sender<u64>,
        stop: &CancellationToken,
    ) -> Result<()> {
        metrics::wal_registered();
        let mut progress = Progress::default();
        let mut retry = LoopBackoff::new(Duration::from_millis(500), Duration::from_secs(10));
        while !stop.is_cancelled() {
            let result = self
                .wal_session(wal, &names, wake, stop, &mut progress)
                .await;
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

    /// One replication session: checks, slot, backfill if due, then reading.
    async fn wal_session(
        &self,
        wal: &WalSource,
        names: &slot::Names,
        wake: &watch::Sender<u64>,
        stop: &CancellationToken,
        p: &mut Progress,
    ) -> Result<()> {
        let pool = self.store.pool();
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
            if slot::create(pool, &names.slot).await? {
                info!(slot = %names.slot, "created the replication slot (pgoutput)");
            }
            p.floor = None;
        }
        let floor = match p.floor {
            Some(floor) => floor,
            None => match self.wal_backfill(wake, stop).await? {
                Some(floor) => {
                    p.floor = Some(floor);
                    floor
                }
                None => return Ok(()),
            },
        };
        let config = wal.replication_config(&names.slot);
        let mut client = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            c = ReplicationClient::connect(config) => c.map_err(|e| wal_error("connecting for replication", &e))?,
        };
        metrics::wal_up(true);
        if p.failing {
            info!(slot = %names.slot, "WAL source reading again");
            p.failing = false;
        }
        let result = tokio::select! {
            r = self.wal_read(&mut client, names, floor, stop, p) => r,
            () = self.wal_slot_stats(&names.slot) => Ok(()),
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), client.shutdown()).await;
        result
    }

    /// Lets the polling workers publish every fresh row up to the highest
    /// seq handed out now, and waits until none is left and no transaction
    /// can still commit one (the horizon passed it). The seq it returns is
    /// the WAL reader's floor. `None` when `stop` came first.
    async fn wal_backfill(
        &self,
        wake: &watch::Sender<u64>,
        stop: &CancellationToken,
    ) -> Result<Option<i64>> {
        let floor = self.store.tick(None).await?.last_seq;
        self.main_until.fetch_max(floor, Ordering::AcqRel);
        wake.send_modify(|n| *n = n.wrapping_add(1));
        let started = Instant::now();
        loop {
            if self.horizon.settled() >= floor && !slot::main_left(self.store.pool(), floor).await?
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

    /// Sets the slot's gauges every stats interval; never returns.
    async fn wal_slot_stats(&self, slot_name: &str) {
        loop {
            if let Ok(Some(state)) = slot::state(self.store.pool(), slot_name).await {
                let at_risk = matches!(state.wal_status.as_deref(), Some("unreserved" | "lost"));
                metrics::wal_slot(state.lag_bytes, at_risk);
            }
            tokio::time::sleep(self.config.stats_interval).await;
        }
    }

    /// Reads transactions, publishes their rows in windows of what is there
    /// (up to a batch), and confirms each window's last commit once its rows
    /// are published and recorded.
    async fn wal_read(
        &self,
        client: &mut ReplicationClient,
        names: &slot::Names,
        floor: i64,
        stop: &CancellationToken,
        p: &mut Progress,
    ) -> Result<()> {
        let max_payload = self.sink.max_payload();
        let mut relations: HashMap<u32, Option<Layout>> = HashMap::new();
        let mut window: Vec<ClaimedRow> = Vec::new();
        // The end of the last commit read whose rows are all in `window` or published.
        let mut confirmable: Option<Lsn> = None;
        // The commit time of the oldest commit not yet confirmed.
        let mut oldest: Option<i64> = None;
        let mut skip = false;
        let mut in_txn = false;
        // The marks of the last window published, being written.
        let mut inflight: Option<Inflight> = None;
        // The payload bytes in `window`.
        let mut window_bytes = 0usize;
        loop {
            if window.is_empty() {
                window_bytes = 0;
            }
            // Wait for the stream inside a transaction (its rest is
            // committed and on its way: a window is not cut short while the
            // client catches up) and when nothing read waits to be published
            // or confirmed; otherwise publish what is there.
            let event = if in_txn || (window.is_empty() && confirmable.is_none()) {
                tokio::select! {
                    () = stop.cancelled() => {
                        if let Some(job) = inflight.take() {
                            job.land(client, p).await?;
                        }
                        return Ok(());
                    }
                    landed = async {
                        match inflight.as_mut() {
                            Some(job) => (&mut job.marks).await,
                            None => std::future::pending().await,
                        }
                    } => {
                        let confirm = inflight.take().and_then(|job| job.confirm);
                        marked(landed)?;
                        if let Some(lsn) = confirm {
                            client.update_applied_lsn(lsn);
                            p.done = lsn;
                        }
                        continue;
                    }
                    ev = client.recv() => Some(ev),
                }
            } else {
                client.recv().now_or_never()
            };
            let Some(event) = event else {
                // Nothing more right now: publish what is there.
                let confirm = if in_txn { None } else { confirmable.take() };
                if !self
                    .wal_settle(client, p, &mut window, confirm, oldest, &mut inflight, stop)
                    .await?
                {
                    return Ok(());
                }
                if confirm.is_some() {
                    oldest = None;
                    metrics::wal_lag(Duration::ZERO);
                }
                continue;
            };
            let event = event
                .map_err(|e| wal_error("reading the replication stream", &e))?
                .ok_or_else(|| Error::new(ErrorKind::Database, "the replication stream ended"))?;
            match event {
                ReplicationEvent::Begin { final_lsn, .. } => {
                    in_txn = true;
                    // Read before (a session that replays from the slot's
                    // confirmed position): published and recorded already.
                    skip = final_lsn < p.done;
                }
                ReplicationEvent::XLogData { data, .. } => {
                    match pgoutput::decode(&data)
                        .map_err(|e| Error::new(ErrorKind::Database, e.to_string()))?
                    {
                        Message::Relation(r) => {
                            let ours = r.name == "outbox_events" && r.namespace == names.schema;
                            let layout = if ours { Some(Layout::of(&r)?) } else { None };
                            relations.insert(r.id, layout);
                        }
                        Message::Insert { relation, values } if !skip => {
                            if let Some(Some(layout)) = relations.get(&relation)
                                && let Inserted::Fresh(row) = layout.row(&values, max_payload)
                                && row.seq > floor
                            {
                                window_bytes += usize::try_from(row.data_len).unwrap_or(usize::MAX);
                                window.push(*row);
                            }
                        }
                        _ => {}
                    }
                    if self.window_full(&window, window_bytes)
                        && !self
                            .wal_settle(client, p, &mut window, None, oldest, &mut inflight, stop)
                            .await?
                    {
                        return Ok(());
                    }
                }
                ReplicationEvent::Commit {
                    end_lsn,
                    commit_time_micros,
                    ..
                } => {
                    in_txn = false;
                    if !skip {
                        confirmable = Some(end_lsn);
                        oldest.get_or_insert(commit_time_micros);
                    }
                    skip = false;
                    if self.window_full(&window, window_bytes) {
                        let confirm = confirmable.take();
                        if !self
                            .wal_settle(
                                client,
                                p,
                                &mut window,
                                confirm,
                                oldest,
                                &mut inflight,
                                stop,
                            )
                            .await?
                        {
                            return Ok(());
                        }
                        oldest = None;
                    }
                }
                // Idle: nothing read is waiting, so the slot may move on
                // (an idle outbox must not hold WAL back).
                ReplicationEvent::KeepAlive { wal_end, .. }
                    if window.is_empty()
                        && confirmable.is_none()
                        && inflight.is_none()
                        && !in_txn
                        && wal_end > p.done =>
                {
                    client.update_applied_lsn(wal_end);
                    p.done = wal_end;
                }
                _ => {}
            }
        }
    }

    /// Whether `window` (`bytes` of payloads) is as large as a window gets:
    /// [`WINDOW_BATCHES`] batches of rows, or the batch byte budget as many
    /// times.
    fn window_full(&self, window: &[ClaimedRow], bytes: usize) -> bool {
        window.len() >= self.config.batch_size.saturating_mul(WINDOW_BATCHES)
            || bytes >= self.config.batch_bytes.saturating_mul(WINDOW_BATCHES)
    }

    /// Publishes `window` ([`wal_flush`](Self::wal_flush)), then lets the
    /// marks of the window before land and confirms its commit, and starts
    /// this window's marks, to be confirmed up to `confirm` once written. So
    /// one window is marked while the next is read and published, and the
    /// slot never passes a row not yet marked. `false` when `stop` came first.
    #[allow(clippy::too_many_arguments)]
    async fn wal_settle(
        &self,
        client: &mut ReplicationClient,
        p: &mut Progress,
        window: &mut Vec<ClaimedRow>,
        confirm: Option<Lsn>,
        oldest_commit: Option<i64>,
        inflight: &mut Option<Inflight>,
        stop: &CancellationToken,
    ) -> Result<bool> {
        let Some(marks) = self.wal_flush(window, oldest_commit, stop).await? else {
            return Ok(false);
        };
        if let Some(job) = inflight.take() {
            job.land(client, p).await?;
        }
        if marks.is_empty() {
            if let Some(lsn) = confirm {
                client.update_applied_lsn(lsn);
                p.done = lsn;
            }
        } else {
            let store = self.store.clone();
            *inflight = Some(Inflight {
                marks: tokio::spawn(async move {
                    let started = Instant::now();
                    let marked = store.mark_published(&marks).await;
                    metrics::phase("mark", started.elapsed());
                    marked
                }),
                confirm,
            });
        }
        Ok(true)
    }

    /// Publishes and records `window` (emptying it): rows behind a row of
    /// their subject in the retry lane are deferred behind it, rows behind a
    /// broker fault are tried again with backoff until they are published or
    /// refused. Returns the marks of the published rows, for the caller to
    /// write off the publish path; `None` when `stop` came before that
    /// (nothing may be confirmed).
    async fn wal_flush(
        &self,
        window: &mut Vec<ClaimedRow>,
        oldest_commit: Option<i64>,
        stop: &CancellationToken,
    ) -> Result<Option<Marks>> {
        let mut marks = Marks::new();
        if window.is_empty() {
            return Ok(Some(marks));
        }
        let mut pending = std::mem::take(window);
        let max_payload = self.sink.max_payload();
        let mut idle = LoopBackoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            if let Some(micros) = oldest_commit {
                let now = chrono::Utc::now().timestamp_micros() - PG_EPOCH_MICROS;
                let lag = u64::try_from(now - micros).unwrap_or(0);
                metrics::wal_lag(Duration::from_micros(lag));
            }
            pending.sort_by_key(|r| r.seq);
            let mut lowest: HashMap<&str, i64> = HashMap::new();
            for row in &pending {
                lowest.entry(row.subject.as_str()).or_insert(row.seq);
            }
            let subjects: Vec<(&str, i64)> = lowest.into_iter().collect();
            let blockers =
                slot::blockers(self.store.pool(), &subjects, self.config.max_attempts).await?;
            for row in &mut pending {
                row.blocker = blockers.get(&row.subject).copied();
            }
            let deadline = Instant::now()
                + self
                    .config
                    .lease
                    .saturating_sub(self.config.publish_timeout);
            let started = Instant::now();
            let mut report = BatchReport {
                claimed: pending.len(),
                ..BatchReport::default()
            };
            metrics::batch(pending.len());
            let result = self
                .publish_rows(
                    pending,
                    deadline,
                    max_payload,
                    &mut report,
                    Some(&mut marks),
                )
                .await;
            let unresolved = match result {
                Ok(unresolved) => {
                    let ok = Ok(report);
                    self.note_db_health(&ok);
                    self.note_broker_idle(&ok);
                    self.report_health();
                    unresolved
                }
                Err(e) => {
                    let failed = Err(e);
                    self.note_db_health(&failed);
                    self.report_health();
                    return failed.map(|_: BatchReport| None);
                }
            };
            metrics::phase("wal", started.elapsed());
            if unresolved.is_empty() {
                return Ok(Some(marks));
            }
            pending = unresolved;
            for row in &mut pending {
                row.blocker = None;
            }
            if report.progress() == 0 {
                tokio::select! {
                    () = stop.cancelled() => return Ok(None),
                    () = tokio::time::sleep(idle.next()) => {}
                }
            } else {
                idle.reset();
            }
        }
    }
}

/// The marks of published rows: id and stream position.
type Marks = Vec<(uuid::Uuid, Option<crate::store::Position>)>;

/// A window's marks being written, and the commit to confirm after them.
#[derive(Debug)]
struct Inflight {
    marks: tokio::task::JoinHandle<Result<u64>>,
    confirm: Option<Lsn>,
}

impl Inflight {
    /// Waits for the marks, then confirms.
    async fn land(self, client: &ReplicationClient, p: &mut Progress) -> Result<()> {
        marked(self.marks.await)?;
        if let Some(lsn) = self.confirm {
            client.update_applied_lsn(lsn);
            p.done = lsn;
        }
        Ok(())
    }
}

/// The outcome of a marks task.
fn marked(joined: std::result::Result<Result<u64>, tokio::task::JoinError>) -> Result<()> {
    joined
        .map_err(|e| Error::new(ErrorKind::Database, format!("marking rows published: {e}")))?
        .map(drop)
}

/// A replication client's error as the relay's.
fn wal_error(doing: &str, e: &PgWireError) -> Error {
    let kind = match e {
        PgWireError::Auth(_) => ErrorKind::Privilege,
        _ => ErrorKind::Database,
    };
    Error::new(kind, format!("{doing}: {e}"))
}
