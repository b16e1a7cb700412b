//! Leadership of an ordered consumer: who may fetch, and the fence that keeps a
//! deposed leader from committing.
//!
//! - **Leadership** is a session-level advisory lock on a connection of its
//!   own. Standbys try it every [`poll_every`]. The server releases it when the
//!   leader's session ends: at once when the process dies (its socket closes),
//!   or after `idle_session_timeout` (the lease timeout) when the leader stops
//!   talking to the database (frozen, or cut off). A keeper task pings every
//!   [`ping_every`]. A failed ping (the session is gone, and the lock with
//!   it) steps down at once; a ping that hangs steps down once nothing is
//!   confirmed for half the timeout, before the server can hand the lock on.
//! - **Pulls end with the lead.** A leader issues each pull only while its
//!   session was confirmed within [`CONFIRM_WINDOW`] ([`Tenure::valid`]),
//!   and each pull expires after [`PULL_EXPIRES`]. So no message is delivered
//!   to a leader later than `CONFIRM_WINDOW + PULL_EXPIRES` after its
//!   session ended, and a new leader whose predecessor did not let go cleanly
//!   waits [`takeover_wait`] before it reads what was left unfinished.
//!   The one window left: a leader frozen between its check and sending its
//!   pull, for longer than the lease timeout, sends that pull late; its
//!   commits are fenced, but the events it then holds come back to the new
//!   leader only after `ack_wait`, possibly after later events of their
//!   subjects. The successor does watch the consumer's delivery sequence
//!   (for its takeover checkpoint, see [`super::checkpoint`]): such a gap
//!   is logged and stops the checkpoint from moving on, but does not yet
//!   hold the subjects back.
//! - **The fence.** Each new leader bumps `inbox_leases.epoch` while holding
//!   the fence lock exclusively. Each handler transaction of a leader, just
//!   before its commit, takes the fence lock shared and reads the epoch
//!   ([`check_fence`]): a mismatch rolls it back. A new epoch therefore waits
//!   for the commits that already passed their check, and no transaction of a
//!   deposed leader commits after it.
//! - **Foreign holders.** Any role may take the leader lock; a standby that
//!   has not led for longer than the lease timeout names a holder whose role
//!   does not own the consumer ([`super::lock_holder`]). The epoch itself is
//!   a row: only the consumer's owner may bump it (row-level security).

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::lock_holder::Watch;
use crate::error::Error;
use crate::fence::FenceKey;

/// How recently a leader's session must have been confirmed for it to pull.
pub(crate) const CONFIRM_WINDOW: Duration = Duration::from_secs(1);
/// Lifetime of one pull request of a leader.
pub(crate) const PULL_EXPIRES: Duration = Duration::from_millis(500);

/// How often a standby tries to take the lead (one cheap statement each).
pub(crate) fn poll_every(timeout: Duration) -> Duration {
    (timeout / 50).clamp(Duration::from_millis(100), Duration::from_millis(250))
}

/// How often the leader pings its session.
fn ping_every(timeout: Duration) -> Duration {
    (timeout / 5).min(CONFIRM_WINDOW / 4)
}

/// How long a new leader waits, when its predecessor did not let go cleanly,
/// for the predecessor's last pull to have expired.
pub(crate) fn takeover_wait() -> Duration {
    CONFIRM_WINDOW + PULL_EXPIRES + Duration::from_millis(250)
}

/// This replica leads the consumer until [`Tenure::lost`] fires.
#[derive(Debug)]
pub(crate) struct Tenure {
    epoch: i64,
    /// The keys of the fence, for the tenure's commits.
    fence_key: FenceKey,
    /// Whether the previous leader let go cleanly, or there was none (nothing
    /// of it can still arrive).
    clean_handover: bool,
    /// When the session was last confirmed; `None` once the lead is lost.
    confirmed: watch::Receiver<Option<Instant>>,
    release: Option<oneshot::Sender<()>>,
    keeper: JoinHandle<()>,
}

impl Tenure {
    /// The fencing epoch of this tenure.
    pub(crate) fn epoch(&self) -> i64 {
        self.epoch
    }

    /// The keys of the fence the tenure's commits take.
    pub(crate) fn fence_key(&self) -> FenceKey {
        self.fence_key
    }

    /// Whether the previous leader let go cleanly.
    pub(crate) fn clean_handover(&self) -> bool {
        self.clean_handover
    }

    /// Whether the session was confirmed within [`CONFIRM_WINDOW`]: only then
    /// may the leader pull.
    pub(crate) fn valid(&self) -> bool {
        self.confirmed
            .borrow()
            .is_some_and(|at| at.elapsed() < CONFIRM_WINDOW)
    }

    /// Resolves once the lead is lost (the session failed, or went unconfirmed
    /// for half the lease timeout).
    pub(crate) async fn lost(&mut self) {
        // An error means the keeper is gone: lost as well.
        let _ = self.confirmed.wait_for(Option::is_none).await;
    }

    /// Gives up the lead (clean shutdown): unlocks and closes the session.
    pub(crate) async fn release(mut self) {
        if let Some(release) = self.release.take() {
            let _ = release.send(());
        }
        if tokio::time::timeout(Duration::from_secs(5), &mut self.keeper)
            .await
            .is_err()
        {
            self.keeper.abort();
        }
    }
}

impl Drop for Tenure {
    fn drop(&mut self) {
        // Dropping without release (step-down, abort): the session closes with
        // the keeper, which releases the lock server-side.
        if self.release.is_some() {
            self.keeper.abort();
        }
    }
}

/// Waits until this replica leads `consumer`, retrying every [`poll_every`]
/// (and across database errors, which it logs). Cancel it by dropping.
pub(crate) async fn acquire(pool: &PgPool, consumer: &str, timeout: Duration) -> Tenure {
    let holder = format!("pid {} ({})", std::process::id(), uuid::Uuid::now_v7());
    let mut conn: Option<PgConnection> = None;
    let mut logged_standby = false;
    let mut watch = Watch::default();
    loop {
        match try_lead(pool, &mut conn, consumer, &holder, timeout).await {
            Ok(Some((epoch, clean_handover, fence_key))) => {
                let Some(conn) = conn.take() else {
                    continue;
                };
                tracing::info!(consumer, epoch, clean_handover, %holder, "this replica leads the ordered consumer");
                let (confirm, confirmed) = watch::channel(Some(Instant::now()));
                let (release, release_rx) = oneshot::channel();
                let keeper = tokio::spawn(keep(
                    conn,
                    (consumer.to_owned(), epoch),
                    timeout,
                    confirm,
                    release_rx,
                ));
                return Tenure {
                    epoch,
                    fence_key,
                    clean_handover,
                    confirmed,
                    release: Some(release),
                    keeper,
                };
            }
            Ok(None) => {
                if !logged_standby {
                    tracing::info!(
                        consumer,
                        "standby: another replica leads the ordered consumer"
                    );
                    logged_standby = true;
                }
                watch.standing_by(pool, consumer, timeout).await;
            }
            Err(e) => {
                tracing::warn!(consumer, error = %e, "cannot try for the lead; retrying");
                conn = None;
                watch.reset();
            }
        }
        tokio::time::sleep(poll_every(timeout)).await;
    }
}

/// One try: `Some((epoch, clean handover))` if the lock was free and the
/// epoch is bumped.
async fn try_lead(
    pool: &PgPool,
    conn: &mut Option<PgConnection>,
    consumer: &str,
    holder: &str,
    timeout: Duration,
) -> Result<Option<(i64, bool, FenceKey)>, Error> {
    let conn = match conn {
        Some(conn) => conn,
        None => {
            // A session of its own, which the server ends when it goes silent
            // for the lease timeout (PostgreSQL 14+: idle_session_timeout).
            // Set by a statement, not a startup parameter, which PgBouncer
            // refuses (`unsupported startup parameter: options`).
            let mut session = PgConnection::connect_with(&pool.connect_options())
                .await
                .map_err(|e| Error::database("opening the leadership session", e))?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "set idle_session_timeout = '{}ms'",
                timeout.as_millis()
            )))
            .execute(&mut session)
            .await
            .map_err(|e| Error::database("setting the leadership session's timeout", e))?;
            conn.insert(session)
        }
    };
    let locked: bool = sqlx::query_file_scalar!("queries/lease_try_lock.sql", consumer)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| Error::database("trying the leadership lock", e))?;
    if !locked {
        return Ok(None);
    }
    let mut tx = conn
        .begin()
        .await
        .map_err(|e| Error::database("beginning the epoch bump", e))?;
    let fence_key = FenceKey::read(&mut tx, consumer).await?;
    fence_key.lock_exclusive(&mut tx).await?;
    let previous: Option<bool> = sqlx::query_file_scalar!("queries/lease_previous.sql", consumer)
        .fetch_optional(&mut *tx)
        .await
        .map_err(|e| Error::database("reading the previous leader's release", e))?;
    let epoch: i64 = sqlx::query_file_scalar!("queries/lease_take.sql", consumer, holder)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| Error::database("bumping the leader epoch", e))?;
    tx.commit()
        .await
        .map_err(|e| Error::database("committing the leader epoch", e))?;
    // No row: no ordered leader ever ran, so none can have a pull open.
    Ok(Some((epoch, previous != Some(false), fence_key)))
}

/// Keeps the leadership session alive, and says when it cannot.
async fn keep(
    mut conn: PgConnection,
    (consumer, epoch): (String, i64),
    timeout: Duration,
    confirm: watch::Sender<Option<Instant>>,
    mut release: oneshot::Receiver<()>,
) {
    let every = ping_every(timeout);
    // A slow ping is waited for (it still confirms); a hung one steps down below.
    let patience = (timeout / 5).max(every);
    let mut confirmed = Instant::now();
    loop {
        tokio::select! {
            released = &mut release => {
                if released.is_err() {
                    // The tenure was dropped, not released: not a clean handover.
                    return;
                }
                let unlocked = sqlx::query_file_scalar!("queries/lease_release.sql", &consumer, epoch)
                    .fetch_one(&mut conn);
                if let Err(e) = tokio::time::timeout(patience, unlocked).await.map_err(|_| "timed out".to_owned())
                    .and_then(|r| r.map_err(|e| e.to_string()))
                {
                    tracing::debug!(%consumer, error = %e, "unlocking the lead failed; closing the session releases it");
                }
                let _ = tokio::time::timeout(patience, conn.close()).await;
                tracing::info!(%consumer, "released the lead of the ordered consumer");
                return;
            }
            () = tokio::time::sleep(every) => {
                let started = Instant::now();
                match tokio::time::timeout(patience, conn.ping()).await {
                    Ok(Ok(())) => {
                        confirmed = started;
                        let _ = confirm.send(Some(confirmed));
                    }
                    Ok(Err(e)) => {
                        // The session, and the lock with it, may be gone already.
                        tracing::warn!(%consumer, error = %e, "stepping down: the leadership session failed");
                        let _ = confirm.send(None);
                        return;
                    }
                    Err(_) => tracing::warn!(%consumer, "leadership session ping timed out"),
                }
                if confirmed.elapsed() > timeout / 2 {
                    tracing::warn!(
                        %consumer, unconfirmed_for = ?confirmed.elapsed(),
                        "stepping down: the leadership session is not confirmed",
                    );
                    let _ = confirm.send(None);
                    return;
                }
            }
        }
    }
}
