//! Real PostgreSQL and nats-server processes for tests, benchmarks and demos.
//!
//! Nothing here is a fake: [`PgServer`] runs `initdb` and `postgres`,
//! [`NatsServer`] runs `nats-server -js`, each on a free loopback port with its
//! data in a temporary directory, and both can be stopped, killed and restarted
//! to inject faults.
//!
//! - [`TestDb::new`] gives a test its own freshly migrated database, on the server
//!   named by `DATABASE_URL` when that is set, otherwise on a PostgreSQL server
//!   shared by the test binary and started on first use.
//! - [`nats`] gives a test its own nats-server, or the one at `NATS_URL`;
//!   [`postgres`] does the same for PostgreSQL and `DATABASE_URL`.
//! - [`NatsCluster`] starts a 3-node JetStream cluster on loopback (routes,
//!   one store directory per node) whose nodes can be killed with `kill -9`
//!   and restarted, the stream leader among them.
//! - [`PgBouncer`] puts a real PgBouncer (transaction or session pooling) in
//!   front of a server.
//! - [`Program`] runs one of the workspace's binaries as a child process.
//! - Secure set-ups, made in the test: [`TestCerts`] (a CA, server and client
//!   certificates), [`PgServer::start_tls`] (TLS only, plain TCP refused),
//!   [`NatsServer::start_with_config`] with [`token_config`], [`NkeyUser`],
//!   [`JwtAuth`] (operator, account and user JWTs, creds file) or
//!   [`TestCerts::nats_tls_block`].
//!
//! PostgreSQL refuses to run as root. Run as root, the harness starts it as the
//! `postgres` user (override with `OUTBOX_TEST_PG_USER`) through `setpriv`.
//! Binaries are found on `PATH`, in `/usr/lib/postgresql/<version>/bin`, or
//! through `PG_BIN_DIR` and `NATS_SERVER_BIN`; a missing one is an error that says
//! how to install it.

/// The user guide's chapter on testing, rendered here from the repository's
/// `docs/`.
pub mod guide {
    #[doc = include_str!("../docs/testing.md")]
    pub mod testing {}
}

mod error;
mod nats;
mod nats_auth;
mod nats_cluster;
mod pg;
mod pgbouncer;
mod process;
mod program;
mod tls;

pub use error::{Error, Result};
pub use nats::{NatsHandle, NatsServer, nats};
pub use nats_auth::{JwtAuth, NkeyUser, token_config};
pub use nats_cluster::NatsCluster;
pub use pg::{PgHandle, PgServer, TestDb, create_database, postgres};
pub use pgbouncer::{PgBouncer, PoolMode};
pub use process::{free_port, wait_until};
pub use program::Program;
pub use tls::{CLIENT_NAME, TestCerts};

/// The crate README's example, compiled as a doc test.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
