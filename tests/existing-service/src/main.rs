//! Applies the service's schema and the outbox's in the order given, then
//! places one order (a row and its event, one transaction) and prints
//! `ok <order> <event id>`. A failure is printed (its message, not its
//! `Debug`) and exits 1.
//!
//! ```text
//! DATABASE_URL=postgres://localhost/shop existing-service app-first|outbox-first|app-tool
//! ```

use std::process::ExitCode;

use existing_service::{BoxError, Order, migrate, place_order};
use sqlx::postgres::PgPoolOptions;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("existing-service: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let order: Order = std::env::args()
        .nth(1)
        .ok_or("usage: existing-service app-first|outbox-first|app-tool")?
        .parse()?;
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await?;
    migrate(&pool, order).await?;
    let id = place_order(&pool).await?;
    println!("ok {order} {id}");
    pool.close().await;
    Ok(())
}
