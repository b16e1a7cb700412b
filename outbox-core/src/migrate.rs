//! The schema: `outbox_events` and `inbox_events`, embedded from `migrations/`.

use sqlx::PgPool;
use sqlx::migrate::Migrator;

use crate::error::{Error, ErrorKind, Result};

/// The embedded migrations, for `MIGRATOR.run(&pool)` or `#[sqlx::test(migrator = …)]`.
/// The same files work with `sqlx migrate run --source migrations`.
pub static MIGRATOR: Migrator = sqlx::migrate!("../migrations");

/// Applies every pending migration.
///
/// # Errors
/// [`ErrorKind::Database`] if a migration fails (it is rolled back) or the
/// database holds a migration this build does not know.
pub async fn migrate(pool: &PgPool) -> Result<()> {
    MIGRATOR.run(pool).await.map_err(|e| {
        Error::new(ErrorKind::Database, format!("running migrations: {e}")).with_source(e)
    })
}
