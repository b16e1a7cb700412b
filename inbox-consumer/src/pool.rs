//! A connection pool for a consumer's handler transactions.
//!
//! sqlx tests a pooled connection before it hands it out (a `Sync` and its
//! answer: one round trip) and again when it comes back. A consumer's
//! connections are seldom idle for long, and the test before use is a round
//! trip on every transaction's path, between the message's arrival and its
//! `BEGIN`. [`handler_pool`] tests a connection before use only when it was
//! idle for [`IDLE_BEFORE_TEST`] or longer: a connection used within that
//! time was tested when it came back (sqlx's release test), so one the server
//! dropped since is found out either way, by the test or by its `BEGIN`,
//! which [`Dedupe`](crate::Dedupe) then sends again on another connection
//! (see `dedupe::begin_tx`).

use std::time::Duration;

use sqlx::Connection;
use sqlx::postgres::PgPoolOptions;

/// How long a pooled connection may sit idle and still be handed out without
/// a test first.
pub const IDLE_BEFORE_TEST: Duration = Duration::from_secs(1);

/// `options` with the test before use skipped for connections idle less than
/// [`IDLE_BEFORE_TEST`] (see the [module docs](self)). `billing` builds its
/// pool with it; any pool works with the consumer.
#[must_use]
pub fn handler_pool(options: PgPoolOptions) -> PgPoolOptions {
    options
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                // A failed test closes the connection; the pool hands out
                // another (or opens one).
                Ok(meta.idle_for < IDLE_BEFORE_TEST || conn.ping().await.is_ok())
            })
        })
}
