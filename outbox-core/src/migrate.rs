//! The schema: `outbox_events` and `inbox_events`, embedded from `migrations/`,
//! and the rule that start-up schema steps run one at a time.
//!
//! Replicas of a service usually start together, and each prepares its
//! database at start-up. The embedded migrations are safe on their own: sqlx's
//! migrator takes an advisory lock of its own before it even creates
//! `_sqlx_migrations` (sqlx 0.8 `Migrator::run_direct`: `lock`, then
//! `ensure_migrations_table`). A service's own DDL is not: two sessions
//! running `create table if not exists t` at once can both find `t` missing,
//! and the second fails with a unique violation on `pg_type_typname_nsp_index`
//! (or `pg_class_relname_nsp_index` for an index). So [`migrate_with`] runs
//! both steps on one connection holding [`MIGRATION_LOCK`], a session-level
//! advisory lock, and closes that connection at the end: the session, and
//! every lock it holds, ends with it whatever happened (sqlx's migrator
//! leaves its own lock held when a migration fails).

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::error::{Error, ErrorKind, Result};

/// The embedded migrations, for `MIGRATOR.run(&pool)` or `#[sqlx::test(migrator = …)]`.
/// The same files work with `sqlx migrate run --source migrations`.
///
/// `MIGRATOR.run` alone does not take [`MIGRATION_LOCK`]; start-up code should
/// call [`migrate`] or [`migrate_with`].
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The advisory lock every start-up schema step holds, in PostgreSQL's two-key
/// space: `pg_advisory_lock(1868721409, 0)` (`0x6f62_6d01`, "obm" and 1).
///
/// Two-key advisory locks never meet single-key ones (`pg_advisory_lock(bigint)`,
/// as sqlx's migrator and many applications take), and this first key is
/// used for nothing else; the relay's shard locks are `0x6f62_7201` and
/// `0x6f62_7202`, the inbox's are `hashtext('inbox_consumer.…')`. A script
/// that changes the schema by hand while services may be starting takes it too:
///
/// ```sql
/// select pg_advisory_lock(1868721409, 0);
/// -- DDL
/// select pg_advisory_unlock(1868721409, 0);
/// ```
pub const MIGRATION_LOCK: (i32, i32) = (0x6f62_6d01, 0);

/// Applies every pending migration, under [`MIGRATION_LOCK`]: the same as
/// [`migrate_with`] with no SQL of the service's own.
///
/// # Errors
/// [`ErrorKind::Database`] if the lock cannot be taken, a migration fails (it
/// is rolled back) or the database holds a migration this build does not know.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    migrate_with(pool, "").await
}

/// Start-up schema preparation for a service: applies every pending embedded
/// migration, then runs `app_sql` (the service's own DDL: any number of
/// `;`-separated statements, sent as one simple query, which PostgreSQL runs
/// as one transaction), both under [`MIGRATION_LOCK`].
///
/// **The rule: every start-up schema step runs under the lock.** Replicas
/// started at the same instant on a fresh database then prepare it one after
/// the other: the first creates the tables, the others wait, then find
/// everything in place. `app_sql` must therefore be idempotent
/// (`create table if not exists …`, `create index if not exists …`,
/// `create or replace function …`): it runs at every start.
///
/// The lock is held on a connection taken from `pool` for the purpose and
/// closed at the end, on success, on error, and when the returned future is
/// dropped, so a failed or cancelled start-up never leaves the lock held on a
/// pooled connection. A replica waits, without a bound of its own, for as long
/// as another holds the lock (bound it with `lock_timeout` in the pool's
/// connect options, or with a timeout around the call).
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
/// outbox_pg::migrate_with(
///     &pool,
///     "create table if not exists subscriptions (id text primary key, plan text not null)",
/// )
/// .await?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`ErrorKind::Database`] if no connection can be had or the lock taken, a
/// migration fails (it is rolled back), the database holds a migration this
/// build does not know, or `app_sql` fails (its statements are rolled back).
pub async fn migrate_with(pool: &PgPool, app_sql: &str) -> Result<()> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| Error::database("connecting to migrate", e))?;
    // Never returned to the pool: closing it ends the session, which releases
    // our lock and sqlx's even if a step below fails or this future is dropped.
    conn.close_on_drop();
    sqlx::query("select pg_advisory_lock($1, $2)")
        .bind(MIGRATION_LOCK.0)
        .bind(MIGRATION_LOCK.1)
        .execute(&mut *conn)
        .await
        .map_err(|e| Error::database("taking the migration lock", e))?;
    MIGRATOR
        .run_direct(None, &mut *conn, false)
        .await
        .map_err(|e| {
            Error::new(ErrorKind::Database, format!("running migrations: {e}")).with_source(e)
        })?;
    if !app_sql.trim().is_empty() {
        sqlx::raw_sql(sqlx::AssertSqlSafe(app_sql.to_owned()))
            .execute(&mut *conn)
            .await
            .map_err(|e| Error::database("running the service's schema SQL", e))?;
    }
    // The schema is in place. A failure to close cleanly changes nothing: the
    // server ends the session, and releases the lock, when the socket closes.
    let _closed = conn.close().await;
    Ok(())
}
