//! The database connection every command opens, and the check that the
//! tables it reads are there.

use std::time::Duration;

use outbox_pg::connect::{DatabaseArgs, Secret};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::error::{Error, ErrorKind, Result};

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
        let pool = args
            .connect(
                PgPoolOptions::new()
                    .max_connections(2)
                    .acquire_timeout(Duration::from_secs(10)),
            )
            .await?;
        require_tables(&pool, tables).await?;
        Ok(pool)
    }
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
        return Ok(());
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
