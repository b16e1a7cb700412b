//! Readiness of a relay: the database answers, the NATS connection is up and
//! the stream exists. [`Readiness::check`] runs the checks, each bounded by a
//! timeout, and returns an [`outbox_pg::health::Report`] naming what failed.
//!
//! It checks the dependencies, not a [`Relay`](crate::Relay): build it from
//! the pool and the client the relay was built from, before the relay is set
//! up (a relay waiting for its broker is not ready), and serve it from your
//! own HTTP server, or use the binaries' (`cli::OpsServer`, feature `cli`).
//!
//! ```no_run
//! # #[allow(dead_code)]
//! # async fn f(pool: sqlx::PgPool, nats: async_nats::Client) {
//! let readiness = outbox_publisher::Readiness::new(pool, nats, "OUTBOX");
//! let report = readiness.check().await;
//! if !report.is_ready() {
//!     eprintln!("{report}"); // not ready: broker: not connected to NATS (state: disconnected); …
//! }
//! # }
//! ```

use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream;
use outbox_pg::health::{self, Check, Report};
use sqlx::PgPool;

/// The default bound on each check: 2 s.
pub const DEFAULT_CHECK_TIMEOUT: Duration = health::DEFAULT_CHECK_TIMEOUT;

/// Checks a relay's dependencies: `database`, `broker` and `stream`.
#[derive(Debug, Clone)]
pub struct Readiness {
    pool: PgPool,
    js: jetstream::Context,
    stream: String,
    timeout: Duration,
}

impl Readiness {
    /// Checks `pool`, `client`'s connection and that `stream` exists.
    pub fn new(pool: PgPool, client: async_nats::Client, stream: impl Into<String>) -> Self {
        Self {
            pool,
            js: jetstream::new(client),
            stream: stream.into(),
            timeout: DEFAULT_CHECK_TIMEOUT,
        }
    }

    /// Bound on each check (default [`DEFAULT_CHECK_TIMEOUT`], 2 s).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Runs the checks: the database answers a round trip, the NATS
    /// connection is `Connected`, and the stream exists. The stream is not
    /// asked for while the broker is down; its check then says so.
    pub async fn check(&self) -> Report {
        let (database, broker) = tokio::join!(health::database(&self.pool, self.timeout), async {
            check_broker(&self.js.client())
        },);
        let stream = if broker.ok() {
            check_stream(&self.js, &self.stream, self.timeout).await
        } else {
            Check::failed("stream", "not checked: the broker is not connected")
        };
        Report::new().with(database).with(broker).with(stream)
    }
}

/// `broker`: the NATS connection is `Connected`.
pub(crate) fn check_broker(client: &async_nats::Client) -> Check {
    match client.connection_state() {
        State::Connected => Check::passed("broker"),
        state => Check::failed("broker", format!("not connected to NATS (state: {state})")),
    }
}

/// `stream`: JetStream answers that `stream` exists, within `timeout`.
async fn check_stream(js: &jetstream::Context, stream: &str, timeout: Duration) -> Check {
    match tokio::time::timeout(timeout, js.get_stream(stream)).await {
        Ok(Ok(_)) => Check::passed("stream"),
        Ok(Err(e)) => Check::failed("stream", stream_failure(stream, &e)),
        Err(_) => Check::failed(
            "stream",
            format!(
                "JetStream did not answer about stream `{stream}` within {}",
                outbox_pg::HumanDuration(timeout)
            ),
        ),
    }
}

/// Why JetStream did not describe `stream`, in a few words, without the
/// client's error text.
pub(crate) fn stream_failure(stream: &str, error: &jetstream::context::GetStreamError) -> String {
    use jetstream::ErrorCode;
    use jetstream::context::GetStreamErrorKind;
    match error.kind() {
        GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND => {
            format!("stream `{stream}` does not exist")
        }
        GetStreamErrorKind::JetStream(e) => format!(
            "JetStream refused to describe stream `{stream}` (error code {})",
            e.error_code().0
        ),
        GetStreamErrorKind::Request => {
            format!("JetStream did not answer about stream `{stream}` (is JetStream enabled?)")
        }
        GetStreamErrorKind::EmptyName | GetStreamErrorKind::InvalidStreamName => {
            format!("`{stream}` is not a valid stream name")
        }
    }
}

impl outbox_pg::health::Probe for Readiness {
    fn check(&self) -> impl std::future::Future<Output = Report> + Send {
        Readiness::check(self)
    }
}
