//! What a binary needs to reach PostgreSQL and NATS in production, shared by
//! the relay and consumer services (feature `connect`).
//!
//! - [`DatabaseArgs`]: `--database-url` (`DATABASE_URL`) or
//!   `--database-url-file` (`DATABASE_URL_FILE`); TLS through the URL
//!   (`sslmode=verify-full&sslrootcert=…`, `sslcert`/`sslkey`).
//! - [`NatsArgs`]: `--nats-url` and credentials (user/password, token, nkey
//!   seed, creds file) and TLS (CA, client certificate); every secret from
//!   an environment variable or a `--*-file` instead of argv, where `ps`
//!   would show it. Its clients log the server's errors, and a permission
//!   the NATS user lacks is named
//!   ([`NatsArgs::permission_denied`]).
//! - [`Secret`] (`secrecy::SecretString`): a string whose `Debug` prints `[REDACTED]`;
//!   [`redact_url`] masks a URL's password for logs, found by parsing the
//!   URL, so a password holding `,` `#` `/` `?` `@` `%` `:` never shows, nor
//!   any piece of one in a URL that does not parse.
//! - [`cancel_on_signal`]: SIGTERM or ctrl-c cancels a `CancellationToken`.
//!
//! ```no_run
//! use clap::Parser;
//! use outbox_pg::connect::{DatabaseArgs, NatsArgs, cancel_on_signal};
//! use tokio_util::sync::CancellationToken;
//!
//! #[derive(Debug, Parser)]
//! struct Args {
//!     #[command(flatten)]
//!     database: DatabaseArgs,
//!     #[command(flatten)]
//!     nats: NatsArgs,
//! }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let args = Args::parse();
//! let pool = args.database.connect(sqlx::postgres::PgPoolOptions::new()).await?;
//! let nats = args.nats.connect("my-service").await?;
//! let shutdown = CancellationToken::new();
//! tokio::spawn(cancel_on_signal(shutdown.clone(), "stopping my-service"));
//! # let _ = (pool, nats); Ok(()) }
//! ```
//!
//! PostgreSQL TLS needs a TLS backend of sqlx in the final binary, which this
//! crate leaves to it: `sqlx = { version = "0.9", features =
//! ["tls-rustls-ring-webpki"] }` (rustls with ring, as async-nats uses).

mod database;
mod nats;
mod redact;
mod secret;
mod signal;
mod violations;

pub use database::DatabaseArgs;
pub use nats::NatsArgs;
pub use redact::redact_url;
pub use secret::{ExposeSecret, Secret, secret_from_file};
pub use signal::cancel_on_signal;
