//! Who holds an ordered consumer's leader lock, when a standby has waited
//! for it longer than a lease.
//!
//! Leadership is a session-level advisory lock keyed by the consumer's name
//! ([`super::lease`]), and any role may take any advisory lock: row-level
//! security keeps another consumer's role from the consumer's rows, lease
//! included, but not from its lock. A session of a role that does not own the
//! consumer holding it keeps every replica standing by, for as long as that
//! session lasts. Such a lock cannot be refused, so it is made visible: a
//! standby that has not got the lead for longer than the lease timeout looks
//! up the lock's holder in `pg_locks` and `pg_stat_activity` and, if that
//! session's role is not a member of the consumer's owner, logs an error
//! naming the role and the pid, at most once per [`REPORT_EVERY`].

use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;

/// How often a standby reports a foreign holder of its leader lock.
pub(crate) const REPORT_EVERY: Duration = Duration::from_secs(60);

/// A standby's watch on its leader lock: when it began standing by, and when
/// it last looked at the holder.
#[derive(Debug, Default)]
pub(crate) struct Watch {
    since: Option<Instant>,
    looked: Option<Instant>,
}

impl Watch {
    /// Another try for the lead failed because the lock is held: once the
    /// standby has waited longer than `lease`, and at most every
    /// [`REPORT_EVERY`], looks up the holder and reports one whose role does
    /// not own `consumer`.
    pub(crate) async fn standing_by(&mut self, pool: &PgPool, consumer: &str, lease: Duration) {
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        if now.duration_since(since) <= lease
            || self
                .looked
                .is_some_and(|at| now.duration_since(at) < REPORT_EVERY)
        {
            return;
        }
        self.looked = Some(now);
        report(pool, consumer, now.duration_since(since)).await;
    }

    /// The lead was taken, or the try failed otherwise: the wait starts over.
    pub(crate) fn reset(&mut self) {
        *self = Self::default();
    }
}

/// Logs an error for each session holding `consumer`'s leader lock under a
/// role that does not own it; a lookup that fails is logged at debug level.
async fn report(pool: &PgPool, consumer: &str, waited: Duration) {
    let holders = match sqlx::query_file!("queries/lease_holder.sql", consumer)
        .fetch_all(pool)
        .await
    {
        Ok(holders) => holders,
        Err(e) => {
            tracing::debug!(consumer, error = %e, "cannot look up who holds the leader lock");
            return;
        }
    };
    for holder in holders.into_iter().filter(|h| !h.owns) {
        let role = holder.role.unwrap_or_else(|| "?".to_owned());
        let owner = holder.owner.unwrap_or_else(|| "?".to_owned());
        tracing::error!(
            consumer,
            pid = holder.pid,
            role = %role,
            owner = %owner,
            application = holder.application.as_deref().unwrap_or(""),
            waited = ?waited,
            "the leader lock of consumer `{consumer}` is held by session {pid} of role `{role}`, \
             which does not own the consumer (its owner is `{owner}`): no replica can lead while \
             that session lasts; end it (select pg_terminate_backend({pid})) and find out why \
             that role took the lock",
            pid = holder.pid,
        );
    }
}
