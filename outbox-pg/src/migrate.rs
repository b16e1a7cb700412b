//! The schema: `outbox_events`, `inbox_events` and their companions, from the
//! SQL files in `outbox-pg/migrations/`, applied either by this library at
//! start-up or by the service's own migration tool, beside the service's own
//! migrations and without touching their history.
//!
//! # One at a time
//!
//! Replicas of a service usually start together, and each prepares its
//! database at start-up. Two sessions running `create table if not exists t`
//! at once can both find `t` missing, and the second fails with a unique
//! violation on `pg_type_typname_nsp_index` (or `pg_class_relname_nsp_index`
//! for an index). So [`migrate_with`] runs each step (the check, each file
//! with its history row, the service's SQL) in a transaction holding
//! [`MIGRATION_LOCK`] transaction-scoped: a second replica waits for the
//! first's step to commit, then finds it done. Each file takes the
//! same lock for its own transaction (`select pg_advisory_xact_lock(1868721409,
//! 0)`), so a service's tool applying the files and a replica starting up
//! take turns as well.
//!
//! Nothing outlives the transaction on the server session: no session lock,
//! no setting, and the statements prepared on it are deallocated before the
//! commit. So a pool behind a transaction pooler (PgBouncer with
//! `pool_mode = transaction`, which hands the server session to another
//! client after each transaction) migrates as well as a direct one, from any
//! number of processes at once.
//!
//! The lock is the schema's own ([`crate::Namespace`]): the second key is 0
//! for `public` and `hashtext(schema)` for another schema, so outboxes of
//! several schemas in one database do not wait on each other's start-up
//! (beyond the length of one file, whose own lock is `(1868721409, 0)`).
//!
//! # Why sqlx's `Migrator`, on a table of our own
//!
//! The files are applied by sqlx's [`Migrator`] with its history table renamed
//! to [`MIGRATION_TABLE`] (`dangerous_set_table_name`) rather than by a runner
//! of our own: each file and its history row commit in one transaction, the
//! table has `_sqlx_migrations`' layout and checksums (SHA-384 of the file),
//! so rows move between the two unchanged, and a changed or unknown file is
//! refused the way sqlx refuses it. Its own advisory lock is turned off:
//! [`MIGRATION_LOCK`] is held instead, and taking sqlx's per-database lock
//! while holding ours could deadlock against a service's sqlx migrator that
//! holds sqlx's lock and waits for ours inside one of these files.
//!
//! The ways to apply the schema, and what becomes of databases migrated by
//! earlier builds, are described on [`migrate`].

use sqlx::migrate::{Migrate, MigrateError, Migrator};
use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{Error, ErrorKind, Result};
use crate::privilege::is_insufficient_privilege;

/// The embedded migrations: the files of `outbox-pg/migrations/`, for the
/// service's own migration tool or to read the SQL.
///
/// Each entry has the file's `version`, `description`, `sql` and sqlx
/// `checksum`. A service that applies its schema with sqlx can apply these
/// with it, in one migrator and one history:
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
/// use sqlx::migrate::Migrator;
/// static APP: Migrator = sqlx::migrate!("./migrations");
/// let both = Migrator::with_migrations(
///     APP.iter().chain(outbox_pg::MIGRATOR.iter()).cloned().collect(),
/// );
/// both.run(&pool).await?;
/// # Ok(()) }
/// ```
///
/// Running `MIGRATOR.run(&pool)` **alone** records these files in
/// `_sqlx_migrations`, where the service's own `sqlx::migrate!` then finds
/// versions it does not know and fails. Start-up code calls [`migrate`] or
/// [`migrate_with`], which keep their history in [`MIGRATION_TABLE`].
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The table [`migrate`] records the applied files in, created in the first
/// schema of the `search_path`: `outbox_schema_migrations`, laid out as
/// sqlx's `_sqlx_migrations`.
pub const MIGRATION_TABLE: &str = "outbox_schema_migrations";

/// sqlx's history table, where earlier builds recorded these files.
const SQLX_TABLE: &str = "_sqlx_migrations";

/// The advisory lock every start-up schema step holds, in PostgreSQL's two-key
/// space: `pg_advisory_lock(1868721409, 0)` (`0x6f62_6d01`, "obm" and 1) for
/// the schema `public`; [`migrate`] holds `(1868721409, hashtext(schema))` for
/// the outbox of another schema.
///
/// Two-key advisory locks never meet single-key ones (`pg_advisory_lock(bigint)`,
/// as sqlx's migrator and many applications take), and this first key is
/// used for nothing else; the relay's shard locks are `0x6f62_7201` and
/// `0x6f62_7202` in `public`, the inbox's are `hashtext('inbox_consumer.…')`
/// (see [`crate::Namespace`]). Each
/// migration file takes it for its transaction
/// (`select pg_advisory_xact_lock(1868721409, 0)`). A script that changes the
/// schema by hand while services may be starting takes it too:
///
/// ```sql
/// select pg_advisory_lock(1868721409, 0);
/// -- DDL
/// select pg_advisory_unlock(1868721409, 0);
/// ```
pub const MIGRATION_LOCK: (i32, i32) = (0x6f62_6d01, 0);

/// Applies every pending migration, under [`MIGRATION_LOCK`], recording it
/// in [`MIGRATION_TABLE`]: the same as [`migrate_with`] with no SQL of the
/// service's own.
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
/// sqlx::migrate!("./migrations").run(&pool).await?; // the service's own schema
/// outbox_pg::migrate(&pool).await?; // the outbox's, beside it, in either order
/// # Ok(()) }
/// ```
///
/// # Two ways to apply the schema
///
/// 1. **The library, at start-up**: [`migrate`] or [`migrate_with`]. The
///    history of these files is kept in their own table,
///    [`MIGRATION_TABLE`] (`outbox_schema_migrations`), never in sqlx's
///    `_sqlx_migrations`. A service that also runs
///    `sqlx::migrate!("./migrations")` for its own schema can call both, in
///    either order: neither migrator sees the other's rows, so neither fails
///    with "migration … was previously applied but is missing".
/// 2. **The service's own tool**: copy the files into its migrations folder
///    (sqlx, refinery, Flyway as `V<version>__<name>.sql`) or apply them with
///    `psql --single-transaction -f` in file-name order, or feed [`MIGRATOR`]'s
///    entries to the service's own sqlx `Migrator`. Their versions are
///    timestamps, so they sort among the service's.
///
/// Both ways can meet on one database: **every file is idempotent** and takes
/// no table lock when its objects are already there (each index, column and
/// trigger is created only after a catalog check; a bare `create index if not
/// exists` would still wait for, and block, every open write to the table).
/// So a start-up [`migrate`] after the service's tool applied the files, or the
/// tool after [`migrate`], changes nothing. When the service's sqlx tool
/// recorded a file in `_sqlx_migrations` with the text this build has, [`migrate`]
/// records it as applied in its own table without running it again, and
/// warns: from then on, a binary on this database whose own
/// `sqlx::migrate!` lacks the copies fails with "previously applied but is
/// missing" ([`explain_migrate_error`] says what that means). Use one way on
/// a database.
///
/// # Databases migrated by earlier builds
///
/// Earlier builds recorded these files in `_sqlx_migrations`. The first
/// [`migrate`] of this one adopts them: each of our versions found
/// there with our description is recorded in [`MIGRATION_TABLE`], and its
/// `_sqlx_migrations` row is deleted when its checksum is not this build's
/// (written by an earlier build of the library). No other row is touched,
/// and a row with this build's checksum stays (the service's own tool wrote
/// it from its copy of the files and would otherwise apply them again). So on
/// the first start after upgrading, call [`migrate`] before the service's own
/// `sqlx::migrate!`, which until then still finds our rows it does not know.
///
/// # Another schema
///
/// No name is schema-qualified: the tables, the sequence, the functions and
/// [`MIGRATION_TABLE`] are created in the first schema of the session's
/// `search_path`, and every query of the library, the relay and the inbox
/// finds them through it. To keep them out of `public`, give every
/// connection the same path, in the URL
/// (`postgres://…/app?options=-csearch_path%3Dtenant`) or with
/// `alter role app set search_path = tenant`. The triggers' functions resolve
/// `outbox_events_seq` through the path of the session that inserts, so a
/// writer must use that path too (as it must for the unqualified
/// `outbox_events` anyway).
///
/// # Errors
/// [`ErrorKind::Database`] if the lock cannot be taken, a migration fails (it
/// is rolled back; the message names its file), or [`MIGRATION_TABLE`] records
/// a migration this build does not have or one whose text differs from this
/// build's.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    migrate_with(pool, "").await
}

/// Start-up schema preparation for a service: applies every pending embedded
/// migration, recording it in [`MIGRATION_TABLE`], then runs `app_sql` (the
/// service's own DDL: any number of `;`-separated statements, sent as one
/// simple query, which PostgreSQL runs as one transaction), both under
/// [`MIGRATION_LOCK`].
///
/// The service's own migration history, sqlx's `_sqlx_migrations`, is left
/// alone, but for the rows earlier builds of this library wrote there (see
/// [`migrate`], which also describes the other way to apply the schema, with
/// the service's own tool): a service may run its `sqlx::migrate!` before or
/// after this call.
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
/// # Under a role that does not own the schema
///
/// Services should run under a role granted only what they use
/// (`ops/sql/roles.sql`), with the migrations applied by the schema's owner.
/// Such a role may still call this at start-up: when [`MIGRATION_TABLE`]
/// records every embedded migration with this build's text, nothing that
/// needs ownership or CREATE runs (only the lock and a read of
/// [`MIGRATION_TABLE`]), and `app_sql` refused for want of a privilege
/// (SQLSTATE `42501`: `create table if not exists` needs CREATE on the schema
/// even when the table is there) is rolled back and left to the owner, not
/// returned. A schema that is not up to date under such a role is an error
/// saying to migrate as the owner (`outboxctl migrate`).
///
/// # What it logs
///
/// One line at INFO saying what it did ([`Migrated`]'s `Display`): the files
/// applied, or that the schema is up to date, and what became of `app_sql`
/// (applied, or left to the owner: the role and the server's reason).
/// PostgreSQL's notices (`relation … already exists, skipping`) are turned
/// off in each step's transaction (`set local client_min_messages =
/// warning`).
///
/// # Errors
/// [`ErrorKind::Database`] if no connection can be had or the lock taken, a
/// migration fails (it is rolled back; the message names its file),
/// [`MIGRATION_TABLE`] records a migration this build does not have or one
/// whose text differs from this build's, or `app_sql` fails for a reason
/// other than a missing privilege (its statements are rolled back).
/// [`ErrorKind::Privilege`] if migrations are pending and the role may not
/// apply them (the message lists them and says to run them as the owner), or
/// the role may not read [`MIGRATION_TABLE`].
pub async fn migrate_with(pool: &PgPool, app_sql: &str) -> Result<()> {
    let report = migrate_report(pool, app_sql).await?;
    tracing::info!("{report}");
    Ok(())
}

/// What [`migrate_report`] did: the files it applied, how many the build has,
/// and what became of the service's SQL. Its `Display` is the one line a
/// service logs at start (`outbox schema: applied 17 migrations (…)`, `outbox
/// schema up to date (17 migrations)`, then what became of the service's SQL).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Migrated {
    /// The embedded files applied by this call, by file name, in order;
    /// empty when the schema was up to date.
    pub applied: Vec<String>,
    /// How many embedded migrations this build has.
    pub total: usize,
    /// The role the migrations ran as.
    pub role: String,
    /// What became of the service's own SQL.
    pub app_sql: AppSql,
}

/// What became of the service's own SQL given to [`migrate_report`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AppSql {
    /// None was given.
    None,
    /// It ran and committed.
    Applied,
    /// The role may not run it (SQLSTATE `42501`): rolled back, left to the
    /// schema's owner (`outboxctl migrate`); the server's reason.
    LeftToOwner(String),
}

impl std::fmt::Display for Migrated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.applied.first(), self.applied.last()) {
            (Some(first), Some(last)) if first == last => {
                write!(f, "outbox schema: applied migration {first}")?;
            }
            (Some(first), Some(last)) => write!(
                f,
                "outbox schema: applied {} migrations ({first} … {last})",
                self.applied.len()
            )?,
            _ => write!(f, "outbox schema up to date ({} migrations)", self.total)?,
        }
        match &self.app_sql {
            AppSql::None => Ok(()),
            AppSql::Applied => f.write_str("; the service's schema SQL applied"),
            AppSql::LeftToOwner(why) => write!(
                f,
                "; the service's schema SQL left to the owner (role `{}` may not run it: {why}; \
                 the owner applies it with outboxctl migrate)",
                self.role
            ),
        }
    }
}

/// [`migrate_with`] without its log line: applies what is pending, runs
/// `app_sql`, and says what it did. For a tool that reports it itself
/// (`outboxctl migrate`).
///
/// # Errors
/// As [`migrate_with`].
pub async fn migrate_report(pool: &PgPool, app_sql: &str) -> Result<Migrated> {
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| Error::database("connecting to migrate", e))?;
    // Never returned to the pool: its statement cache does not outlive the
    // DEALLOCATEs below.
    conn.close_on_drop();
    // Each step is one transaction under a transaction-scoped lock, so
    // nothing is left on the server session when it ends, however it ends:
    // this works the same through a transaction pooler (PgBouncer's
    // `pool_mode = transaction` hands the session to another client after
    // COMMIT).
    let mut tx = begin_locked(&mut conn).await?;
    let role: String = sqlx::query_scalar("select current_user::text")
        .persistent(false)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| Error::database("reading the current role", e))?;
    let pending = pending(&mut tx, &role).await?;
    let applied = if pending.is_empty() {
        // Nothing to apply: no step that needs ownership or CREATE runs, so a
        // role that only uses the tables starts on an up-to-date schema.
        if let Err(e) = adopt(&mut tx).await {
            if !is_insufficient_privilege(&e) {
                return Err(e);
            }
            tracing::warn!(
                role = %role, error = %e,
                "the schema is up to date; leaving the outbox's rows of _sqlx_migrations to the owner"
            );
        }
        commit(tx).await?;
        Vec::new()
    } else {
        commit(tx).await?;
        apply_pending(&mut conn, &role, &pending).await?;
        pending.clone()
    };
    let app_sql = run_app_sql(&mut conn, app_sql).await?;
    let _closed = conn.close().await;
    Ok(Migrated {
        applied,
        total: up_migrations().count(),
        role,
        app_sql,
    })
}

/// The embedded up-migrations, in order.
fn up_migrations() -> impl Iterator<Item = &'static sqlx::migrate::Migration> {
    MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
}

/// Applies the pending files, one transaction per file, as sqlx applies
/// them: a failing file is rolled back alone, the ones before it stay
/// applied and recorded.
async fn apply_pending(conn: &mut PgConnection, role: &str, pending: &[String]) -> Result<()> {
    for version in up_migrations().map(|m| m.version) {
        let mut tx = begin_locked(conn).await?;
        apply_up_to(&mut tx, version).await.map_err(|e| {
            if is_insufficient_privilege(&e) {
                not_up_to_date(role, pending, e)
            } else {
                e
            }
        })?;
        commit(tx).await?;
    }
    Ok(())
}

/// Runs the service's own SQL in a step of its own; a refusal for want of a
/// privilege is rolled back and reported, not returned.
async fn run_app_sql(conn: &mut PgConnection, app_sql: &str) -> Result<AppSql> {
    if app_sql.trim().is_empty() {
        return Ok(AppSql::None);
    }
    let mut tx = begin_locked(conn).await?;
    match sqlx::raw_sql(sqlx::AssertSqlSafe(app_sql.to_owned()))
        .execute(&mut *tx)
        .await
    {
        Ok(_) => {
            commit(tx).await?;
            Ok(AppSql::Applied)
        }
        Err(e) if is_insufficient_privilege(&e) => {
            drop(tx); // rolled back
            // The service's own DDL (`create table if not exists …`) needs
            // CREATE on the schema or ownership of its tables even when
            // they are there; a role that only uses them is refused.
            let why = match e.as_database_error() {
                Some(d) => d.message().to_owned(),
                None => crate::db_error_text(&e),
            };
            Ok(AppSql::LeftToOwner(why))
        }
        Err(e) => Err(Error::database("running the service's schema SQL", e)),
    }
}

/// Begins a transaction holding the schema's migration lock, on a session
/// cleared of prepared statements: another client's (a pooler's session is
/// shared) would clash with ours, and this connection's cache is emptied
/// first so it names none that is gone.
async fn begin_locked(conn: &mut PgConnection) -> Result<sqlx::Transaction<'_, sqlx::Postgres>> {
    let mut tx = conn
        .begin()
        .await
        .map_err(|e| Error::database("beginning a migration step", e))?;
    tx.clear_cached_statements()
        .await
        .map_err(|e| Error::database("clearing the session's prepared statements", e))?;
    deallocate(&mut tx).await?;
    sqlx::query(
        "select pg_advisory_xact_lock($1, case when current_schema() = 'public' then 0
                                               else hashtext(current_schema()) end)",
    )
    .bind(MIGRATION_LOCK.0)
    .persistent(false)
    .execute(&mut *tx)
    .await
    .map_err(|e| Error::database("taking the migration lock", e))?;
    // No NOTICE at all from the steps (`relation … already exists, skipping`
    // from each `if not exists`, which sqlx logs at INFO): transaction-scoped,
    // so nothing is left on a pooler's shared session.
    sqlx::raw_sql("set local client_min_messages = warning")
        .execute(&mut *tx)
        .await
        .map_err(|e| Error::database("quieting the migration's notices", e))?;
    Ok(tx)
}

/// Commits a step, after dropping the statements it prepared, so the
/// session goes back as clean as it came.
async fn commit(mut tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<()> {
    tx.clear_cached_statements()
        .await
        .map_err(|e| Error::database("clearing the session's prepared statements", e))?;
    deallocate(&mut tx).await?;
    tx.commit()
        .await
        .map_err(|e| Error::database("committing a migration step", e))
}

/// Drops every prepared statement of the session.
async fn deallocate(conn: &mut PgConnection) -> Result<()> {
    sqlx::raw_sql("deallocate all")
        .execute(&mut *conn)
        .await
        .map(drop)
        .map_err(|e| Error::database("clearing the session's prepared statements", e))
}

/// The embedded migrations [`MIGRATION_TABLE`] does not record as applied
/// with this build's text, by file name; empty when the schema is up to date.
/// A version recorded there that this build does not have counts as pending
/// too (the migrator then names it).
///
/// Read-only, so a role that does not own the tables can tell; only the
/// SELECT of [`MIGRATION_TABLE`] is needed (`ops/sql/roles.sql` grants it).
async fn pending(conn: &mut PgConnection, role: &str) -> Result<Vec<String>> {
    let found: bool = sqlx::query_scalar("select to_regclass($1) is not null")
        .bind(MIGRATION_TABLE)
        .persistent(false)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| Error::database(&format!("looking for {MIGRATION_TABLE}"), e))?;
    let recorded: Vec<(i64, bool, Vec<u8>)> = if found {
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "select version, success, checksum from {MIGRATION_TABLE}"
        )))
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| {
            if is_insufficient_privilege(&e) {
                Error::new(
                    ErrorKind::Privilege,
                    format!(
                        "role `{role}` lacks SELECT on table {MIGRATION_TABLE}, so cannot tell \
                         whether the schema is up to date; grant it outbox_writer, outbox_relay \
                         or outbox_consumer (ops/sql/roles.sql)"
                    ),
                )
                .with_source(e)
            } else {
                Error::database(&format!("reading {MIGRATION_TABLE}"), e)
            }
        })?
    } else {
        Vec::new()
    };
    let mut pending: Vec<String> = MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .filter(|m| {
            !recorded.iter().any(|(version, success, checksum)| {
                *version == m.version && *success && *checksum == *m.checksum
            })
        })
        .map(|m| file_name(m.version))
        .collect();
    pending.extend(
        recorded
            .iter()
            .filter(|(version, ..)| !MIGRATOR.iter().any(|m| m.version == *version))
            .map(|(version, ..)| format!("version {version}, unknown to this build")),
    );
    Ok(pending)
}

/// The error of a role that may not apply what is pending.
fn not_up_to_date(role: &str, pending: &[String], cause: Error) -> Error {
    Error::new(
        ErrorKind::Privilege,
        format!(
            "the outbox schema is not up to date (pending: {}) and role `{role}` may not change \
             it ({cause}): run the migrations as the schema owner (outboxctl migrate, \
             outbox_pg::migrate, or the files of outbox-pg/migrations/), then ops/sql/roles.sql",
            pending.join(", ")
        ),
    )
    .with_source(cause)
}

/// Creates [`MIGRATION_TABLE`], adopts our rows of `_sqlx_migrations`, then
/// applies what is still pending up to `version` (the caller goes through the
/// versions in order, so at most that one). The caller holds
/// [`MIGRATION_LOCK`] in the transaction `conn` is in.
async fn apply_up_to(conn: &mut PgConnection, version: i64) -> Result<()> {
    let mut migrator = Migrator::with_migrations(
        MIGRATOR
            .iter()
            .filter(|m| m.version <= version)
            .cloned()
            .collect(),
    );
    migrator.dangerous_set_table_name(MIGRATION_TABLE);
    // MIGRATION_LOCK is held instead (see the module docs).
    migrator.set_locking(false);
    // Versions after this one, recorded by another process, are checked by
    // the steps that reach them; the last step (every file) refuses a version
    // this build does not have.
    let last = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(version);
    migrator.set_ignore_missing(version < last);
    conn.ensure_migrations_table(MIGRATION_TABLE)
        .await
        .map_err(|e| migrate_error(&format!("creating {MIGRATION_TABLE}"), e))?;
    adopt(conn).await?;
    migrator
        .run_direct(None, conn, false)
        .await
        .map_err(|e| migrate_error("running the outbox schema migrations", e))
}

/// Records in [`MIGRATION_TABLE`] each of our files that `_sqlx_migrations`
/// holds as applied under our version and description, and deletes those rows
/// whose checksum is not this build's (an earlier build of this library
/// wrote them); one transaction. Nothing happens without `_sqlx_migrations`.
async fn adopt(conn: &mut PgConnection) -> Result<()> {
    // A role that may not read it (a service's, when the owner's tool keeps
    // its history there) has nothing to adopt: the owner's migrate did.
    let found: bool = sqlx::query_scalar(
        "select coalesce(has_table_privilege(to_regclass($1)::oid, 'select'), false)",
    )
    .bind(SQLX_TABLE)
    .persistent(false)
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| Error::database("looking for _sqlx_migrations", e))?;
    if !found {
        return Ok(());
    }
    let mut tx = conn
        .begin()
        .await
        .map_err(|e| Error::database("adopting _sqlx_migrations rows", e))?;
    let theirs = sqlx_rows(&mut tx).await?;
    if theirs.is_empty() {
        return Ok(());
    }
    let ours: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "select version from {MIGRATION_TABLE}"
    )))
    .fetch_all(&mut *tx)
    .await
    .map_err(|e| Error::database(&format!("reading {MIGRATION_TABLE}"), e))?;
    let mut kept = Vec::new();
    for row in theirs {
        kept.extend(adopt_row(&mut tx, &ours, row).await?);
    }
    tx.commit()
        .await
        .map_err(|e| Error::database("adopting _sqlx_migrations rows", e))?;
    if let (Some(first), Some(last)) = (kept.first(), kept.last()) {
        warn_applied_both_ways(*first, *last);
    }
    Ok(())
}
/// A row of `_sqlx_migrations`: version, description, checksum.
type SqlxRow = (i64, String, Vec<u8>);

/// The successful rows of `_sqlx_migrations` under our versions.
async fn sqlx_rows(conn: &mut PgConnection) -> Result<Vec<SqlxRow>> {
    let versions: Vec<i64> = MIGRATOR.iter().map(|m| m.version).collect();
    sqlx::query_as(
        "select version, description, checksum from _sqlx_migrations
          where success and version = any($1)
          order by version",
    )
    .bind(&versions)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| Error::database("reading _sqlx_migrations", e))
}

/// Adopts one row of `_sqlx_migrations`: if it is one of our files (version
/// and description), records it in [`MIGRATION_TABLE`] unless `ours` has it,
/// and deletes it if its checksum is not this build's. Its version if it
/// is ours and kept.
async fn adopt_row(
    conn: &mut PgConnection,
    ours: &[i64],
    (version, description, checksum): SqlxRow,
) -> Result<Option<i64>> {
    let Some(migration) = MIGRATOR
        .iter()
        .find(|m| m.version == version && *m.description == *description)
    else {
        return Ok(None); // same version, another description: not ours
    };
    if !ours.contains(&version) {
        conn.skip(MIGRATION_TABLE, migration).await.map_err(|e| {
            migrate_error(
                &format!(
                    "recording {} in {MIGRATION_TABLE}",
                    file_name(migration.version)
                ),
                e,
            )
        })?;
    }
    if *checksum == *migration.checksum {
        return Ok(Some(version));
    }
    sqlx::query(
        "delete from _sqlx_migrations
          where version = $1 and description = $2 and checksum = $3",
    )
    .bind(version)
    .bind(&description)
    .bind(&checksum)
    .execute(&mut *conn)
    .await
    .map_err(|e| {
        Error::database(
            &format!(
                "removing {} from _sqlx_migrations",
                file_name(migration.version)
            ),
            e,
        )
    })?;
    Ok(None)
}

/// Warns that our migrations `first..=last` are recorded both ways.
fn warn_applied_both_ways(first: i64, last: i64) {
    tracing::warn!(
        versions = %format!("{first}..={last}"),
        "the outbox migrations are applied both ways on this database: recorded in \
         _sqlx_migrations by a migrator of the service's own (from copies of the files) and \
         in {MIGRATION_TABLE} by outbox_pg::migrate. A binary whose own sqlx::migrate! lacks \
         the copies fails with \"migration {first} was previously applied but is missing\" \
         (outbox_pg::explain_migrate_error says so). {}",
        one_way(first, last)
    );
}

/// What to do about the outbox's migrations `first..=last` recorded both
/// ways on one database.
fn one_way(first: i64, last: i64) -> String {
    format!(
        "Use one way on a database: keep the copies in every binary's migrations and stop \
         calling outbox_pg::migrate, or remove the copies and the rows (delete from \
         _sqlx_migrations where version between {first} and {last}) and call \
         outbox_pg::migrate in every binary"
    )
}

/// A failure of the service's own sqlx migrator (`sqlx::migrate!(…).run(…)`)
/// as an [`Error`] that says what it means when it is about the outbox's
/// migrations, which sqlx's wording does not.
///
/// Applied both ways on one database (see [`migrate`]): a migrator that had
/// the outbox's files (copied into its folder, or [`MIGRATOR`] chained into
/// it) recorded them in `_sqlx_migrations`, and a binary whose migrator lacks
/// them then fails with sqlx's "migration 20260101000001 was previously
/// applied but is missing in the resolved migrations", which names nothing of
/// ours. This names the file, the two ways, and what to run. Any other
/// failure keeps sqlx's message.
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
/// outbox_pg::migrate(&pool).await?;
/// sqlx::migrate!("./migrations")
///     .run(&pool)
///     .await
///     .map_err(outbox_pg::explain_migrate_error)?;
/// # Ok(()) }
/// ```
pub fn explain_migrate_error(e: MigrateError) -> Error {
    let ours = |v: i64| MIGRATOR.iter().any(|m| m.version == v);
    let message = match &e {
        MigrateError::VersionMissing(v) if ours(*v) => format!(
            "_sqlx_migrations records the outbox migration {}, which this migrator does not \
             have (sqlx: {e}). Either an earlier build of outbox-pg recorded it there: call \
             outbox_pg::migrate once before this migrator, and it moves those rows to its own \
             table, {MIGRATION_TABLE}. Or the outbox's migrations were applied both ways on \
             this database, by a migrator that had copies of the files (or outbox_pg::MIGRATOR \
             chained in) and by outbox_pg::migrate. {}",
            file_name(*v),
            one_way(
                MIGRATOR.iter().map(|m| m.version).min().unwrap_or(*v),
                MIGRATOR.iter().map(|m| m.version).max().unwrap_or(*v),
            ),
        ),
        MigrateError::VersionMismatch(v) if ours(*v) => format!(
            "_sqlx_migrations records the outbox migration {} with another text than this \
             migrator's copy (sqlx: {e}; copies of the files from another outbox-pg version): copy the \
             files of the outbox-pg version the service uses, or call outbox_pg::migrate instead \
             (which also adopts rows an earlier build wrote there)",
            file_name(*v)
        ),
        other => format!("running the service's migrations: {other}"),
    };
    Error::new(ErrorKind::Schema, message).with_source(e)
}

/// The file a version was embedded from, `20260101000001_outbox_events.sql`,
/// for messages (sqlx's description is the name with `_` as spaces).
fn file_name(version: i64) -> String {
    match MIGRATOR.iter().find(|m| m.version == version) {
        Some(m) => format!("{version}_{}.sql", m.description.replace(' ', "_")),
        None => format!("version {version}"),
    }
}

/// An [`ErrorKind::Database`] error saying what failed and, where the error
/// is about one migration, which file.
fn migrate_error(context: &str, e: MigrateError) -> Error {
    let message = match &e {
        MigrateError::ExecuteMigration(cause, version) => {
            format!(
                "applying migration {}: {}",
                file_name(*version),
                crate::db_error_text(cause)
            )
        }
        MigrateError::VersionMissing(version) => format!(
            "{MIGRATION_TABLE} records migration {version}, which this build of outbox-pg \
             does not have (a newer build migrated this database)"
        ),
        MigrateError::VersionMismatch(version) => format!(
            "migration {} was applied from a different text than this build's \
             (its checksum in {MIGRATION_TABLE} differs)",
            file_name(*version)
        ),
        MigrateError::Dirty(version) => format!(
            "migration {} is recorded as failed in {MIGRATION_TABLE}",
            file_name(*version)
        ),
        other => format!("{context}: {other}"),
    };
    Error::new(ErrorKind::Database, message).with_source(e)
}
