//! A stand-in for a service that had a schema, and sqlx migrations, of its own
//! before it took up the outbox: `migrations/` holds its tables (`customers`,
//! `orders`), applied with `sqlx::migrate!` and recorded in `_sqlx_migrations`.
//! The outbox's schema goes beside them in one of three [`Order`]s, and
//! [`place_order`] then writes an order and its event in one transaction.
//!
//! The acceptance tests in `tests/` run the `existing-service` binary, alone,
//! twice, and two at once, against real PostgreSQL databases in `public` and
//! in a schema of their own.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use outbox_pg::{Envelope, EventId, Outbox};
use serde_json::json;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

/// Any error of this crate: the binary prints it and exits 1.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The service's own migrations, as it always ran them.
pub static APP_MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The folder of the service's own migrations, for a tool that reads files.
pub fn app_migrations_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations")
}

/// The folder the outbox's SQL files are copied from: `OUTBOX_MIGRATIONS_DIR`
/// if set, else `outbox-pg/migrations` of this workspace (what a service
/// would copy from the `outbox-pg` package).
pub fn outbox_migrations_dir() -> PathBuf {
    match std::env::var_os("OUTBOX_MIGRATIONS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../outbox-pg/migrations"),
    }
}

/// How the service applies the outbox's schema beside its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Its own `sqlx::migrate!` first, then `outbox_pg::migrate`.
    AppFirst,
    /// `outbox_pg::migrate` first, then its own `sqlx::migrate!`.
    OutboxFirst,
    /// The outbox's SQL files copied into its own migrations folder and run
    /// by its own sqlx `Migrator`; the library is not called.
    AppTool,
}

impl Order {
    /// Every order, for tests.
    pub const ALL: [Order; 3] = [Order::AppFirst, Order::OutboxFirst, Order::AppTool];

    /// The command-line name.
    pub fn as_str(self) -> &'static str {
        match self {
            Order::AppFirst => "app-first",
            Order::OutboxFirst => "outbox-first",
            Order::AppTool => "app-tool",
        }
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Order {
    type Err = BoxError;

    fn from_str(s: &str) -> Result<Self, BoxError> {
        Order::ALL
            .into_iter()
            .find(|o| o.as_str() == s)
            .ok_or_else(|| {
                format!("unknown order `{s}`: app-first, outbox-first or app-tool").into()
            })
    }
}

/// Applies the service's schema and the outbox's, in `order`.
///
/// # Errors
/// The first step that fails, named.
pub async fn migrate(pool: &PgPool, order: Order) -> Result<(), BoxError> {
    match order {
        Order::AppFirst => {
            run_app_migrations(pool).await?;
            outbox_pg::migrate(pool).await?;
        }
        Order::OutboxFirst => {
            outbox_pg::migrate(pool).await?;
            run_app_migrations(pool).await?;
        }
        Order::AppTool => {
            let migrator = app_tool_migrator().await?;
            migrator
                .run(pool)
                .await
                .map_err(|e| format!("the service's migrations with the outbox's files: {e}"))?;
        }
    }
    Ok(())
}

async fn run_app_migrations(pool: &PgPool) -> Result<(), BoxError> {
    APP_MIGRATOR
        .run(pool)
        .await
        // sqlx's "previously applied but is missing" about our files is
        // explained: the outbox's schema was applied both ways here.
        .map_err(|e| {
            format!(
                "the service's own migrations: {}",
                outbox_pg::explain_migrate_error(e)
            )
            .into()
        })
}

/// A sqlx `Migrator` over one folder holding the service's migrations and
/// the outbox's SQL files, copied in as a service would copy them: the way a
/// service with `sqlx migrate run` or `sqlx::migrate!` applies our schema with
/// its own tool. Their versions are timestamps, so both sets sort together.
///
/// # Errors
/// If a folder cannot be read or copied, or sqlx cannot read the result.
pub async fn app_tool_migrator() -> Result<Migrator, BoxError> {
    let folder = tempfile::tempdir()?;
    for dir in [app_migrations_dir(), outbox_migrations_dir()] {
        let entries =
            std::fs::read_dir(&dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
        for entry in entries {
            let path = entry?.path();
            if let Some(name) = path.file_name()
                && path.extension().is_some_and(|x| x == "sql")
            {
                std::fs::copy(&path, folder.path().join(name))
                    .map_err(|e| format!("copying {}: {e}", path.display()))?;
            }
        }
    }
    // Reads every file now: the folder may go once this returns.
    let migrator = Migrator::new(folder.path())
        .await
        .map_err(|e| format!("reading {}: {e}", folder.path().display()))?;
    Ok(migrator)
}

/// Writes a customer, an order and its `order.placed` event in one
/// transaction; returns the event's id (also the order's).
///
/// # Errors
/// If a statement or the commit fails.
pub async fn place_order(pool: &PgPool) -> Result<EventId, BoxError> {
    let customer = "cust_1";
    let mut tx = pool.begin().await?;
    sqlx::query("insert into customers (id, name) values ($1, 'Ada') on conflict do nothing")
        .bind(customer)
        .execute(&mut *tx)
        .await?;
    let event = Envelope::new(
        "order.placed",
        "existing-service",
        customer,
        json!({"customer_id": customer, "amount": 1200}),
    )?;
    let order = event.id().to_string();
    sqlx::query("insert into orders (id, customer_id, amount) values ($1, $2, 1200)")
        .bind(&order)
        .bind(customer)
        .execute(&mut *tx)
        .await?;
    let id = Outbox::unvalidated().enqueue(&mut tx, &event).await?;
    tx.commit().await?;
    Ok(id)
}
