//! The slot, the publication and the checks of the WAL source, made and read
//! with sqlx on the relay's pool (the SQL is in `queries/wal_*.sql`).

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool};
use tracing::warn;

use crate::error::{Error, ErrorKind, Result};
use crate::store::Blocker;

/// The names the WAL source reads under.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    /// The schema holding `outbox_events`.
    pub(crate) schema: String,
    /// The slot's name, which is the publication's too.
    pub(crate) slot: String,
}

/// A replication slot as the server sees it.
#[derive(Debug, Clone)]
pub(crate) struct SlotState {
    pub(crate) plugin: Option<String>,
    pub(crate) database: Option<String>,
    pub(crate) wal_status: Option<String>,
    /// The confirmed position, in bytes from `0/0`.
    pub(crate) confirmed: Option<i64>,
    pub(crate) lag_bytes: Option<i64>,
}

impl SlotState {
    /// The WAL it needs was removed: it can never be read again.
    pub(crate) fn is_lost(&self) -> bool {
        self.wal_status.as_deref() == Some("lost")
    }
}

/// The schema of the outbox the pool's sessions find, and the slot's name
/// (`slot`, or the default for that schema and database).
///
/// # Errors
/// [`ErrorKind::Config`] when there is no `outbox_events` table or `slot` is
/// not a valid slot name; [`ErrorKind::Database`] when the database cannot
/// be read.
pub(crate) async fn names(pool: &PgPool, slot: Option<&str>) -> Result<Names> {
    let found = sqlx::query_file!("queries/wal_outbox_table.sql")
        .fetch_optional(pool)
        .await
        .map_err(|e| Error::database("finding the outbox table for the WAL source", e))?
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Config,
                "no outbox_events table on the search path: run the outbox migrations (outbox_pg::migrate)",
            )
        })?;
    let slot = match slot {
        Some(name) if super::valid_slot_name(name) => name.to_owned(),
        Some(name) => {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "`{name}` is not a replication slot name: use 1 to 63 lower-case letters, digits and `_`"
                ),
            ));
        }
        None => super::default_slot_name(&found.database, &found.schema),
    };
    Ok(Names {
        schema: found.schema,
        slot,
    })
}

/// The start-up checks: `wal_level = logical`, a role that may replicate,
/// and a free slot when `slot` does not exist yet.
///
/// # Errors
/// [`ErrorKind::Config`] naming `wal_level` or `max_replication_slots` and
/// what to change; [`ErrorKind::Privilege`] naming the role and the
/// `alter role … replication` to run.
pub(crate) async fn check(pool: &PgPool, slot: &str) -> Result<()> {
    let s = sqlx::query_file!("queries/wal_settings.sql")
        .fetch_one(pool)
        .await
        .map_err(|e| Error::database("reading the server's replication settings", e))?;
    if s.wal_level != "logical" {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "--source wal needs wal_level=logical; this server has wal_level={}: set \
                 `wal_level = logical` in postgresql.conf (or `alter system set wal_level = logical`) \
                 and restart PostgreSQL, or run the relay with --source poll",
                s.wal_level
            ),
        ));
    }
    if !s.can_replicate {
        return Err(Error::new(
            ErrorKind::Privilege,
            format!(
                "role `{}` may not open a replication connection or create a replication slot: \
                 run `alter role \"{}\" replication` as a superuser, or run the relay with --source poll",
                s.role, s.role
            ),
        ));
    }
    if state(pool, slot).await?.is_none() && s.free_slots <= 0 {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "no free replication slot for `{slot}`: every one of max_replication_slots is in use \
                 (`select slot_name, active from pg_replication_slots` lists them); drop an unused one \
                 or raise max_replication_slots and restart PostgreSQL"
            ),
        ));
    }
    Ok(())
}

/// Creates the publication of `names` if it is missing.
///
/// # Errors
/// [`ErrorKind::Config`] when a publication of that name exists without
/// `<schema>.outbox_events`; [`ErrorKind::Privilege`] when the role may not
/// create it (the message gives the statement to run as the table's owner).
pub(crate) async fn ensure_publication(pool: &PgPool, names: &Names) -> Result<()> {
    let found = sqlx::query_file!("queries/wal_publication.sql", names.slot, names.schema)
        .fetch_one(pool)
        .await
        .map_err(|e| Error::database("reading the WAL source's publication", e))?;
    if found.has_table {
        return Ok(());
    }
    if found.exists {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "publication `{}` exists but does not carry {}.outbox_events: \
                 `alter publication {} add table {}.outbox_events`, or drop it and let the relay create it",
                names.slot, names.schema, names.slot, names.schema
            ),
        ));
    }
    let ddl = sqlx::query_file_scalar!("queries/wal_publication_ddl.sql", names.slot, names.schema)
        .fetch_one(pool)
        .await
        .map_err(|e| Error::database("preparing the WAL source's publication", e))?;
    match sqlx::raw_sql(sqlx::AssertSqlSafe(ddl.clone()))
        .execute(pool)
        .await
    {
        Ok(_) => {
            tracing::info!(publication = %names.slot, "created the publication of outbox_events (inserts)");
            Ok(())
        }
        // Made meanwhile by another relay.
        Err(e) if outbox_pg::sqlstate(&e).as_deref() == Some("42710") => Ok(()),
        Err(e) if outbox_pg::is_insufficient_privilege(&e) => Err(Error::new(
            ErrorKind::Privilege,
            format!(
                "the relay's role may not create the publication of outbox_events; run, as the \
                 table's owner: {ddl}"
            ),
        )),
        Err(e) => Err(Error::database("creating the WAL source's publication", e)),
    }
}

/// Slot `slot`, if it exists.
///
/// # Errors
/// [`ErrorKind::Database`].
pub(crate) async fn state(pool: &PgPool, slot: &str) -> Result<Option<SlotState>> {
    let row = sqlx::query_file!("queries/wal_slot.sql", slot)
        .fetch_optional(pool)
        .await
        .map_err(|e| Error::database("reading the WAL source's replication slot", e))?;
    Ok(row.map(|r| SlotState {
        plugin: r.plugin,
        database: r.database,
        wal_status: r.wal_status,
        confirmed: r.confirmed,
        lag_bytes: r.lag_bytes,
    }))
}

/// How long a slot's creation may wait before the relay names what it waits
/// for, and then how often it names them again.
const SLOT_WAIT_FIRST: Duration = Duration::from_secs(5);
const SLOT_WAIT_EVERY: Duration = Duration::from_secs(30);
/// How long reading what a slot's creation waits for may take.
const SLOT_WAITS_READ: Duration = Duration::from_secs(5);

/// Creates slot `slot` (pgoutput); `false` if it existed already. While the
/// server holds the creation back for transactions still running (in any of
/// its databases), says which, every [`SLOT_WAIT_EVERY`].
///
/// # Errors
/// [`ErrorKind::Privilege`] without the REPLICATION attribute;
/// [`ErrorKind::Database`] otherwise.
pub(crate) async fn create(pool: &PgPool, slot: &str) -> Result<bool> {
    let failed = |e| Error::database("creating the WAL source's replication slot", e);
    let mut conn = pool.acquire().await.map_err(failed)?;
    let pid = sqlx::query_file_scalar!("queries/backend_pid.sql")
        .fetch_one(&mut *conn)
        .await
        .map_err(failed)?;
    let creating =
        sqlx::query_file_scalar!("queries/wal_slot_create.sql", slot).fetch_one(&mut *conn);
    tokio::pin!(creating);
    let mut report = tokio::time::Instant::now() + SLOT_WAIT_FIRST;
    let created = loop {
        tokio::select! {
            created = &mut creating => break created,
            () = tokio::time::sleep_until(report) => {
                log_slot_waits(pool, pid, slot).await;
                report += SLOT_WAIT_EVERY;
            }
        }
    };
    match created {
        Ok(_) => Ok(true),
        Err(e) if outbox_pg::sqlstate(&e).as_deref() == Some("42710") => Ok(false),
        Err(e) if outbox_pg::is_insufficient_privilege(&e) => Err(Error::new(
            ErrorKind::Privilege,
            format!(
                "the relay's role may not create replication slot `{slot}`: grant it REPLICATION"
            ),
        )),
        Err(e) => Err(failed(e)),
    }
}

/// Logs the sessions the creation of `slot` on backend `pid` waits for,
/// one line each (`queries/wal_slot_waits.sql`).
async fn log_slot_waits(pool: &PgPool, pid: i32, slot: &str) {
    let waits = tokio::time::timeout(
        SLOT_WAITS_READ,
        sqlx::query_file!("queries/wal_slot_waits.sql", pid).fetch_all(pool),
    )
    .await;
    let waits = match waits {
        Ok(Ok(waits)) => waits,
        Ok(Err(e)) => {
            warn!(%slot, error = %e, "creating the replication slot takes long; could not read what it waits for");
            return;
        }
        Err(_) => {
            warn!(%slot, "creating the replication slot takes long; reading what it waits for timed out");
            return;
        }
    };
    if waits.is_empty() {
        warn!(%slot, "creating the replication slot takes long, waiting for no session the server names");
    }
    for w in waits {
        warn!(
            %slot,
            pid = w.pid,
            database = w.database.as_deref().unwrap_or(""),
            application = w.application.as_deref().unwrap_or(""),
            client = w.client.as_deref().unwrap_or(""),
            state = w.state.as_deref().unwrap_or(if w.pid == 0 { "prepared" } else { "" }),
            age_secs = w.age_secs,
            "creating the replication slot waits for a transaction still running on the server (in any \
             database): PostgreSQL starts a slot only once every transaction running when it was asked \
             for has ended, so the WAL source reads nothing until then (commit, roll back or end it; a \
             prepared one, pid 0, with COMMIT PREPARED or ROLLBACK PREPARED)"
        );
    }
}

/// Drops slot `slot`.
///
/// # Errors
/// [`ErrorKind::Database`] (a slot in use cannot be dropped).
pub(crate) async fn drop_slot(pool: &PgPool, slot: &str) -> Result<()> {
    sqlx::query_file!("queries/wal_slot_drop.sql", slot)
        .execute(pool)
        .await
        .map(drop)
        .map_err(|e| Error::database("dropping the WAL source's replication slot", e))
}

/// Tries to take the lead of `slot` on `conn` (a session lock, held while
/// the session lives).
///
/// # Errors
/// [`ErrorKind::Database`].
pub(crate) async fn try_lead(conn: &mut PgConnection, slot: &str) -> Result<bool> {
    sqlx::query_file_scalar!("queries/wal_lead.sql", slot)
        .fetch_one(conn)
        .await
        .map_err(|e| Error::database("taking the lead of the WAL source", e))
}

/// Whether a fresh row at or below `seq` is still waiting.
///
/// # Errors
/// [`ErrorKind::Database`].
pub(crate) async fn main_left(pool: &PgPool, seq: i64) -> Result<bool> {
    sqlx::query_file_scalar!("queries/wal_main_left.sql", seq)
        .fetch_one(pool)
        .await
        .map_err(|e| Error::database("counting the rows left to the polling path", e))
}

/// For each subject (with the lowest seq the WAL source has of it), the
/// earlier row of it in the retry lane that holds it back, if any.
///
/// # Errors
/// [`ErrorKind::Database`].
pub(crate) async fn blockers(
    pool: &PgPool,
    subjects: &[(&str, i64)],
    max_attempts: i32,
) -> Result<HashMap<String, Blocker>> {
    if subjects.is_empty() {
        return Ok(HashMap::new());
    }
    let names: Vec<&str> = subjects.iter().map(|s| s.0).collect();
    let seqs: Vec<i64> = subjects.iter().map(|s| s.1).collect();
    let rows = sqlx::query_file!(
        "queries/wal_blockers.sql",
        &names as &[&str],
        &seqs,
        max_attempts
    )
    .fetch_all(pool)
    .await
    .map_err(|e| Error::database("looking up the subjects waiting in the retry lane", e))?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let due: Option<DateTime<Utc>> = r.due;
            let blocker = match (r.parked, due) {
                (false, Some(t)) => Blocker::Until(t),
                _ => Blocker::Parked,
            };
            (r.subject, blocker)
        })
        .collect())
}

/// The oldest fresh row of a shard, as [`fresh_probe`] finds it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FreshRow {
    pub(crate) shard: i16,
    pub(crate) id: uuid::Uuid,
    pub(crate) seq: i64,
}

/// Per shard of `shards`, its oldest fresh row with a seq above the shard's
/// entry in `after` and at or below `settled`; and the WAL insert position
/// (bytes from `0/0`) that every one of their commits precedes
/// (`queries/wal_fresh_probe.sql`).
/// `None` for the position when no shard has one.
///
/// # Errors
/// [`ErrorKind::Database`].
pub(crate) async fn fresh_probe(
    pool: &PgPool,
    shards: &[i16],
    after: &[i64],
    settled: i64,
) -> Result<(Vec<FreshRow>, Option<i64>)> {
    let failed = |e| Error::database("looking for fresh rows the WAL source has read", e);
    // The plan the probe needs, whatever the statistics say (see the file).
    let mut tx = pool.begin().await.map_err(failed)?;
    sqlx::query_file!("queries/wal_fresh_probe_plan.sql")
        .execute(&mut *tx)
        .await
        .map_err(failed)?;
    let rows = sqlx::query_file!("queries/wal_fresh_probe.sql", shards, after, settled)
        .fetch_all(&mut *tx)
        .await
        .map_err(failed)?;
    tx.commit().await.map_err(failed)?;
    let lsn = rows.iter().map(|r| r.lsn).max();
    let found = rows
        .into_iter()
        .map(|r| FreshRow {
            shard: r.shard,
            id: r.id,
            seq: r.seq,
        })
        .collect();
    Ok((found, lsn))
}

/// The transactions of `xids` (as the replication stream names them) not yet
/// visible to a new statement (`queries/wal_invisible.sql`).
///
/// # Errors
/// [`ErrorKind::Database`].
pub(crate) async fn invisible(pool: &PgPool, xids: &[u32]) -> Result<Vec<u32>> {
    if xids.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = xids.iter().map(|&x| i64::from(x)).collect();
    let rows = sqlx::query_file_scalar!("queries/wal_invisible.sql", &ids)
        .fetch_all(pool)
        .await
        .map_err(|e| {
            Error::database(
                "checking that transactions read from the WAL are visible",
                e,
            )
        })?;
    Ok(rows
        .into_iter()
        .filter_map(|x| u32::try_from(x).ok())
        .collect())
}

/// Which of `ids`, rows read from the WAL whose transactions are visible,
/// are still fresh (`queries/wal_still_fresh.sql`); the others have an
/// outcome.
///
/// # Errors
/// [`ErrorKind::Database`].
pub(crate) async fn still_fresh(pool: &PgPool, ids: &[uuid::Uuid]) -> Result<Vec<uuid::Uuid>> {
    // Unprepared, planned for the table as it is (see the file).
    sqlx::query_file_scalar!("queries/wal_still_fresh.sql", ids)
        .persistent(false)
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("checking rows read from the WAL", e))
}

/// The server's WAL insert position (`queries/wal_insert_lsn.sql`): every
/// transaction committed before the call ends below it.
///
/// # Errors
/// [`ErrorKind::Database`].
pub(crate) async fn insert_lsn(pool: &PgPool) -> Result<u64> {
    let lsn = sqlx::query_file_scalar!("queries/wal_insert_lsn.sql")
        .fetch_one(pool)
        .await
        .map_err(|e| Error::database("reading the WAL position", e))?;
    Ok(u64::try_from(lsn).unwrap_or(0))
}
