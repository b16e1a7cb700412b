//! The database connection every command opens, and the check that the
//! tables it reads are there.

use std::time::Duration;

use outbox_pg::connect::{DatabaseArgs, Secret};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{Error, ErrorKind, Result};

/// How long reaching the server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Columns of later migrations that commands read, by table: a database
/// whose tables predate them is told to run the migrations, not shown a
/// failing statement.
const REQUIRED_COLUMNS: &[(&str, &str)] = &[
    ("outbox_events", "skipped_at"),
    ("outbox_events", "published_seq"),
    ("outbox_events", "due_at"),
    ("outbox_events", "cancelled_at"),
    ("inbox_dead_letters", "replay_count"),
    ("inbox_consumers", "owner"),
];

/// `--database-url` / `--database-url-file`, accepted before or after the
/// command (`outboxctl --database-url … status` and `outboxctl status
/// --database-url …`).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Database {
    /// PostgreSQL URL (prefer DATABASE_URL or --database-url-file: argv is
    /// visible to `ps`).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        global = true,
        value_name = "DATABASE_URL"
    )]
    database_url: Option<Secret>,

    /// File holding the PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL_FILE", global = true, value_name = "PATH")]
    database_url_file: Option<std::path::PathBuf>,
}

impl Database {
    /// Connects (the first connection is made here, so a wrong URL or a
    /// refused login fails at once) and checks that `tables` exist.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] without a URL or with two; [`ErrorKind::Connect`]
    /// if the server cannot be reached; [`ErrorKind::MissingTable`] naming
    /// each missing table.
    pub(crate) async fn connect(&self, tables: &[&str]) -> Result<PgPool> {
        let pool = self.open(tables).await?;
        if let Some((role, subject)) = row_security(&pool, tables).await? {
            eprintln!(
                "outboxctl: warning: role `{role}` is subject to the row-level security of {}:                  it sees only the rows of the consumers it owns; run outboxctl as the tables'                  owner to see every consumer",
                subject.join(", ")
            );
        }
        Ok(pool)
    }

    /// [`connect`](Self::connect) for a command that must see and change
    /// every row of `tables`: a session subject to their row-level security
    /// is refused.
    ///
    /// # Errors
    /// As [`connect`](Self::connect); [`ErrorKind::Config`] naming the role
    /// when row-level security applies to it.
    pub(crate) async fn connect_as_owner(&self, tables: &[&str]) -> Result<PgPool> {
        let pool = self.open(tables).await?;
        if let Some((role, subject)) = row_security(&pool, tables).await? {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "role `{role}` is subject to the row-level security of {}: run this as the                      tables' owner (who ran the migrations) or a superuser",
                    subject.join(", ")
                ),
            ));
        }
        Ok(pool)
    }

    async fn open(&self, tables: &[&str]) -> Result<PgPool> {
        let args = match (&self.database_url, &self.database_url_file) {
            (Some(url), None) => DatabaseArgs::from_url(url.clone()),
            (None, Some(path)) => DatabaseArgs {
                database_url: None,
                database_url_file: Some(path.clone()),
            },
            (None, None) => {
                return Err(Error::new(
                    ErrorKind::Config,
                    "no database given: set DATABASE_URL or pass --database-url (or --database-url-file)",
                ));
            }
            (Some(_), Some(_)) => {
                return Err(Error::new(
                    ErrorKind::Config,
                    "--database-url and --database-url-file both given: pass one",
                ));
            }
        };
        // One connection first, on its own: a pool retries a refused
        // connection until its timeout and then reports only that it timed
        // out, where this names the cause (refused, unknown host, password).
        let options = args.connect_options()?;
        let shown = args.redacted();
        let refused = |why: String| {
            Error::new(
                ErrorKind::Connect,
                format!("connecting to the database at {shown}: {why}"),
            )
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options)).await {
            Err(_) => {
                return Err(refused(format!(
                    "no answer within {}s",
                    CONNECT_TIMEOUT.as_secs()
                )));
            }
            Ok(Err(e)) => return Err(refused(outbox_pg::db_error_text(&e))),
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
            }
        }
        // JIT off on each connection (a `SET`, not a startup parameter, which
        // PgBouncer refuses): with many scheduled rows the planner, taking the
        // lanes' columns for independent, estimates the retry lane's scans at
        // tens of thousands of rows, and compiling such a plan took longer
        // (~1 s beside 200k scheduled rows) than running it (a few ms).
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(CONNECT_TIMEOUT)
            .after_connect(|conn, _| {
                Box::pin(
                    async move { sqlx::raw_sql("set jit = off").execute(conn).await.map(drop) },
                )
            })
            .connect_lazy_with(options);
        require_tables(&pool, tables).await?;
        Ok(pool)
    }
}

/// The session's role and those of `tables` whose row-level security applies
/// to it (it is neither their owner nor a superuser), if any.
async fn row_security(pool: &PgPool, tables: &[&str]) -> Result<Option<(String, Vec<String>)>> {
    let names: Vec<String> = tables.iter().map(|t| (*t).to_owned()).collect();
    let rows = sqlx::query_file!("queries/row_security.sql", &names)
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("checking the tables' row security", e))?;
    let Some(role) = rows.first().map(|r| r.role.clone()) else {
        return Ok(None);
    };
    Ok(Some((role, rows.into_iter().map(|r| r.table).collect())))
}

/// Fails naming every one of `tables` the session cannot see (on its
/// `search_path`).
///
/// # Errors
/// [`ErrorKind::MissingTable`]; [`ErrorKind::Database`] if the check fails.
pub(crate) async fn require_tables(pool: &PgPool, tables: &[&str]) -> Result<()> {
    if tables.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = tables.iter().map(|t| (*t).to_owned()).collect();
    let missing: Vec<String> = sqlx::query_file_scalar!("queries/missing_tables.sql", &names)
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("checking the tables", e))?;
    if missing.is_empty() {
        return require_columns(pool, tables).await;
    }
    let database: String = sqlx::query_file_scalar!("queries/current_database.sql")
        .fetch_one(pool)
        .await
        .map_err(|e| Error::database("reading the database name", e))?;
    Err(Error::new(
        ErrorKind::MissingTable,
        format!(
            "table{} {} not found in database `{database}` (on its search_path): run the outbox \
             migrations first (outbox_pg::migrate, or the files of migrations/)",
            if missing.len() == 1 { "" } else { "s" },
            missing.join(", ")
        ),
    ))
}

/// Fails naming the columns of [`REQUIRED_COLUMNS`] that `tables` lack.
async fn require_columns(pool: &PgPool, tables: &[&str]) -> Result<()> {
    let (names, columns): (Vec<String>, Vec<String>) = REQUIRED_COLUMNS
        .iter()
        .filter(|(t, _)| tables.contains(t))
        .map(|(t, c)| ((*t).to_owned(), (*c).to_owned()))
        .unzip();
    if names.is_empty() {
        return Ok(());
    }
    let missing: Vec<String> =
        sqlx::query_file_scalar!("queries/missing_columns.sql", &names, &columns)
            .fetch_all(pool)
            .await
            .map_err(|e| Error::database("checking the tables' columns", e))?;
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::MissingTable,
        format!(
            "the schema predates this outboxctl ({} missing): run the outbox migrations first \
             (outbox_pg::migrate, or the files of migrations/)",
            missing.join(", ")
        ),
    ))
}
