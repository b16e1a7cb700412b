//! Transaction poolers: what works through them, and how a component that
//! needs a session of its own finds out it has none.
//!
//! A pooler in transaction mode (PgBouncer's `pool_mode = transaction`,
//! Odyssey, pgcat, RDS Proxy outside its pinning) gives a client a server
//! session for one transaction at a time. Whatever a client leaves on the
//! session outside a transaction (a session advisory lock, `LISTEN`, a
//! setting, a named prepared statement) stays with the server session and
//! reaches whichever client gets it next.
//!
//! - **Writers** work through one: [`Outbox::enqueue`](crate::Outbox::enqueue)
//!   runs inside the service's transaction and takes nothing else.
//!   PgBouncer before 1.21 does not track prepared statements, so there the
//!   service's pool, and the outbox ([`Outbox::persistent`](crate::Outbox::persistent)),
//!   must use unnamed statements.
//! - **[`migrate`](crate::migrate)** works through one: one transaction under a
//!   transaction-scoped lock, its prepared statements deallocated before the
//!   commit.
//! - **The relay and the consumer runtime** hold session advisory locks
//!   (shard ownership, an ordered consumer's leadership) and `LISTEN`, which
//!   a transaction pooler breaks without an error: locks taken on sessions
//!   other clients then use, shards owned twice or never. They check at
//!   start ([`require_sessions`]) and refuse, naming the pooler, rather than
//!   run: point them at PostgreSQL itself, or at a pool in session mode.

use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};

use crate::error::{Error, ErrorKind, Result};

/// Statements each probe connection runs, alternating with the other.
const ROUNDS: usize = 3;

/// Checks that connections made with `options` each keep one server session
/// of their own, as `component` (`"the relay"`, `"the consumer runtime"`)
/// needs: two connections each ask the server for their backend's pid, in
/// turns. Directly, or through a pool in session mode, each connection sees
/// one pid of its own throughout; through a pooler in transaction or
/// statement mode, statements of one connection run on several sessions, or
/// the two connections on one (PgBouncer hands the session it got back last
/// to the next client).
///
/// The probe opens two connections without `extra_float_digits` (a startup
/// parameter PgBouncer refuses unless told to ignore it) and runs only
/// unnamed statements, so it reaches a pooler's answer instead of failing on
/// one.
///
/// # Errors
/// [`ErrorKind::Config`] when the connections share sessions, naming the
/// pooler and what to do; [`ErrorKind::Database`] if the probe cannot run.
pub async fn require_sessions(options: &PgConnectOptions, component: &str) -> Result<()> {
    let options = options
        .clone()
        .extra_float_digits(None)
        .application_name("outbox session check");
    let mut a = connect(&options).await?;
    let mut b = connect(&options).await?;
    let mut seen_a = Vec::with_capacity(ROUNDS);
    let mut seen_b = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        seen_a.push(backend(&mut a).await?);
        seen_b.push(backend(&mut b).await?);
    }
    let _ = a.close().await;
    let _ = b.close().await;
    judge(&seen_a, &seen_b, component)
}

/// [`require_sessions`] at a component's start-up, where the database may not
/// answer yet: bounded by `timeout`, and only a pooler is an error. A check
/// that cannot run passes with the reason, for the caller to log.
///
/// # Errors
/// [`ErrorKind::Config`], as [`require_sessions`].
pub async fn require_sessions_at_start(
    options: &PgConnectOptions,
    component: &str,
    timeout: Duration,
) -> Result<Option<String>> {
    match tokio::time::timeout(timeout, require_sessions(options, component)).await {
        Ok(Ok(())) => Ok(None),
        Ok(Err(e)) if e.kind() == ErrorKind::Config => Err(e),
        Ok(Err(e)) => Ok(Some(e.to_string())),
        Err(_) => Ok(Some(format!(
            "the database did not answer within {}",
            crate::HumanDuration(timeout)
        ))),
    }
}

async fn connect(options: &PgConnectOptions) -> Result<PgConnection> {
    options
        .connect()
        .await
        .map_err(|e| Error::database("connecting to check for a transaction pooler", e))
}

async fn backend(conn: &mut PgConnection) -> Result<i32> {
    sqlx::query_scalar("select pg_backend_pid()")
        .persistent(false)
        .fetch_one(conn)
        .await
        .map_err(|e| Error::database("checking for a transaction pooler", e))
}

/// The verdict on the backend pids two connections saw, in turns.
fn judge(a: &[i32], b: &[i32], component: &str) -> Result<()> {
    let stable = |seen: &[i32]| seen.windows(2).all(|w| w[0] == w[1]);
    let shared = a.iter().any(|p| b.contains(p));
    if stable(a) && stable(b) && !shared {
        return Ok(());
    }
    let mut pids: Vec<i32> = a.iter().chain(b).copied().collect();
    pids.sort_unstable();
    pids.dedup();
    Err(Error::new(
        ErrorKind::Config,
        format!(
            "the database URL leads to a connection pooler in transaction (or statement) mode, \
             such as PgBouncer with pool_mode = transaction: two connections ran their \
             statements on {} server sessions shared between them (backend pids {pids:?}). \
             {component} holds session locks (shard ownership, leadership) and LISTEN, which \
             such a pooler hands to other clients, so it refuses to run through it. Give it a \
             session of its own: point its database URL at PostgreSQL directly, or at a pool \
             in session mode (pool_mode = session); writers and migrations may keep the \
             transaction pool",
            pids.len()
        ),
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code

    use super::judge;
    use crate::ErrorKind;

    #[test]
    fn sessions_of_their_own_pass() {
        judge(&[10, 10, 10], &[11, 11, 11], "the relay").unwrap();
    }

    #[test]
    fn a_shared_or_moving_session_is_a_pooler_named_with_what_to_do() {
        for (a, b) in [
            (&[10, 10, 10], &[10, 10, 10]), // LIFO reuse: both on one session
            (&[10, 11, 10], &[12, 12, 12]), // one connection moved
            (&[10, 10, 10], &[11, 10, 11]), // the other landed on the first's
        ] {
            let err = judge(a, b, "the relay").unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config);
            let message = err.to_string();
            for needle in [
                "pool_mode = transaction",
                "the relay",
                "pool_mode = session",
            ] {
                assert!(message.contains(needle), "{message}");
            }
        }
    }
}
