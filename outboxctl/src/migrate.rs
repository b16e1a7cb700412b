//! `outboxctl migrate`: the schema's owner applies the outbox's migrations
//! and, with `--sql-dir`, a directory of the service's own, so that no
//! service ever has to start as the owner to prepare its database.
//!
//! The outbox's files are applied by `outbox_pg::migrate_report`, exactly as
//! a service's start-up `outbox_pg::migrate_with` would (history in
//! `outbox_schema_migrations`, in the first schema of the connection's
//! `search_path`: give the URL the services' path,
//! `?options=-csearch_path%3Dtenant`). The service's files are read as sqlx
//! reads a migrations folder: `<version>_<description>.sql`, applied in
//! version order, each once, recorded in `--sql-table` (sqlx's own
//! `_sqlx_migrations` by default, so `sqlx migrate run` and a service's
//! `sqlx::migrate!` of the same folder agree with it). They run in one
//! transaction holding the schema's migration lock: either every pending
//! file is applied and recorded, or none; a file changed after it was
//! applied is refused, naming it.
//!
//! `--json`:
//!
//! ```text
//! {"role": "app_owner", "outbox": {"applied": ["20260101000001_outbox_events.sql", …], "total": 17},
//!  "sql_dir": {"dir": "migrations", "table": "_sqlx_migrations", "applied": ["20260301000001_invoices.sql"], "total": 1}}
//! ```

use std::io::Write;
use std::path::PathBuf;

use serde::Serialize;
use sqlx::migrate::{Migrate, MigrateError, Migrator};
use sqlx::{Connection, PgConnection};

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::{self, Report};

/// `outboxctl migrate`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// A directory of the service's own migrations (`<version>_<name>.sql`,
    /// as `sqlx migrate add` names them), applied after the outbox's, in
    /// version order, each once.
    #[arg(long, value_name = "DIR")]
    sql_dir: Option<PathBuf>,

    /// The table recording the files of `--sql-dir` (sqlx's layout), created
    /// if missing. Versions it records that the directory lacks are left
    /// alone (another service's files sharing it).
    #[arg(long, value_name = "TABLE", default_value = "_sqlx_migrations")]
    sql_table: String,
}

#[derive(Debug, Serialize)]
struct Migrated {
    role: String,
    outbox: Applied,
    #[serde(skip_serializing_if = "Option::is_none")]
    sql_dir: Option<DirApplied>,
}

#[derive(Debug, Serialize)]
struct Applied {
    applied: Vec<String>,
    total: usize,
}

#[derive(Debug, Serialize)]
struct DirApplied {
    dir: String,
    table: String,
    applied: Vec<String>,
    total: usize,
}

impl Report for Migrated {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let outbox = &self.outbox;
        if outbox.applied.is_empty() {
            writeln!(
                out,
                "outbox schema up to date ({} migrations)",
                outbox.total
            )?;
        } else {
            writeln!(
                out,
                "outbox schema: applied {} of {} migrations as role {}",
                outbox.applied.len(),
                outbox.total,
                self.role
            )?;
            for file in &outbox.applied {
                writeln!(out, "  {file}")?;
            }
        }
        let Some(dir) = &self.sql_dir else {
            return Ok(());
        };
        if dir.applied.is_empty() {
            return writeln!(
                out,
                "{}: up to date ({} migrations, recorded in {})",
                dir.dir, dir.total, dir.table
            );
        }
        writeln!(
            out,
            "{}: applied {} of {} migrations, recorded in {}",
            dir.dir,
            dir.applied.len(),
            dir.total,
            dir.table
        )?;
        for file in &dir.applied {
            writeln!(out, "  {file}")?;
        }
        Ok(())
    }
}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    // Read first: a wrong directory changes nothing in the database.
    let migrator = match &args.sql_dir {
        Some(dir) => Some(read_dir(dir, &args.sql_table).await?),
        None => None,
    };
    let pool = db.connect(&[]).await?;
    // A failed migration is the database's answer, not a connection's.
    let report = outbox_pg::migrate_report(&pool, "")
        .await
        .map_err(|e| Error::new(ErrorKind::Database, outbox_pg::error_line(&e)))?;
    let sql_dir = match (&args.sql_dir, migrator) {
        (Some(dir), Some(migrator)) => {
            let mut conn = pool
                .acquire()
                .await
                .map_err(|e| Error::database("connecting to migrate", e))?;
            let applied = apply_dir(&mut conn, &migrator, &args.sql_table).await?;
            Some(DirApplied {
                dir: dir.display().to_string(),
                table: args.sql_table.clone(),
                applied: applied.iter().map(|v| file_name(&migrator, *v)).collect(),
                total: migrator.iter().count(),
            })
        }
        _ => None,
    };
    pool.close().await;
    output::print(
        &Migrated {
            role: report.role.clone(),
            outbox: Applied {
                applied: report.applied.clone(),
                total: report.total,
            },
            sql_dir,
        },
        json,
    )
}

/// The migrations of `dir`, for `table`.
async fn read_dir(dir: &std::path::Path, table: &str) -> Result<Migrator> {
    if !dir.is_dir() {
        return Err(Error::new(
            ErrorKind::Config,
            format!("--sql-dir {}: not a directory", dir.display()),
        ));
    }
    let mut migrator = Migrator::new(dir).await.map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("--sql-dir {}: {e}", dir.display()),
        )
    })?;
    if migrator.iter().any(|m| {
        outbox_pg::MIGRATOR
            .iter()
            .any(|ours| ours.version == m.version)
    }) {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "--sql-dir {} holds a version of the outbox's own migrations: give the service's \
                 files versions of their own (the outbox's are applied anyway)",
                dir.display()
            ),
        ));
    }
    migrator.dangerous_set_table_name(table.to_owned());
    // The schema's migration lock is held instead, transaction-scoped.
    migrator.set_locking(false);
    migrator.set_ignore_missing(true);
    Ok(migrator)
}

/// Applies what `table` does not record of `migrator`'s files, in one
/// transaction under the schema's migration lock; the versions applied.
async fn apply_dir(conn: &mut PgConnection, migrator: &Migrator, table: &str) -> Result<Vec<i64>> {
    let mut tx = conn
        .begin()
        .await
        .map_err(|e| Error::database("beginning the migration", e))?;
    sqlx::raw_sql(
        "set local client_min_messages = warning;
         select pg_advisory_xact_lock(1868721409, case when current_schema() = 'public' then 0
                                                       else hashtext(current_schema()) end)",
    )
    .execute(&mut *tx)
    .await
    .map_err(|e| Error::database("taking the migration lock", e))?;
    tx.ensure_migrations_table(table)
        .await
        .map_err(|e| migrate_error(migrator, &format!("creating {table}"), e))?;
    let before: Vec<i64> = tx
        .list_applied_migrations(table)
        .await
        .map_err(|e| migrate_error(migrator, &format!("reading {table}"), e))?
        .into_iter()
        .map(|m| m.version)
        .collect();
    migrator
        .run_direct(None, &mut *tx, false)
        .await
        .map_err(|e| migrate_error(migrator, "applying the service's migrations", e))?;
    tx.commit()
        .await
        .map_err(|e| Error::database("committing the service's migrations", e))?;
    Ok(migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration() && !before.contains(&m.version))
        .map(|m| m.version)
        .collect())
}

/// The file a version of `migrator` was read from, as sqlx names it.
fn file_name(migrator: &Migrator, version: i64) -> String {
    match migrator.iter().find(|m| m.version == version) {
        Some(m) => format!("{version}_{}.sql", m.description.replace(' ', "_")),
        None => format!("version {version}"),
    }
}

/// A failure of the service's migrations, naming the file; nothing of them
/// was applied (one transaction).
fn migrate_error(migrator: &Migrator, context: &str, e: MigrateError) -> Error {
    let message = match &e {
        MigrateError::ExecuteMigration(cause, version) => format!(
            "applying {}: {}; none of the directory's pending files was applied",
            file_name(migrator, *version),
            outbox_pg::db_error_text(cause)
        ),
        MigrateError::VersionMismatch(version) => format!(
            "{} was changed after it was applied (its checksum differs from the recorded one): \
             add a new file instead; nothing was applied",
            file_name(migrator, *version)
        ),
        MigrateError::Dirty(version) => format!(
            "{} is recorded as failed: fix the database and its row, then run again",
            file_name(migrator, *version)
        ),
        MigrateError::Execute(cause) => {
            format!("{context}: {}", outbox_pg::db_error_text(cause))
        }
        other => format!("{context}: {other}"),
    };
    Error::new(ErrorKind::Database, message)
}
