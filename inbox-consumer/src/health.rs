//! Readiness of a consumer: the database answers, the NATS connection is up,
//! the stream exists and so does the durable consumer. [`Readiness::check`]
//! runs the checks, each bounded by a timeout, and returns an
//! [`outbox_pg::health::Report`] naming what failed.
//!
//! Serve it from your own HTTP server (or the binaries' ops server,
//! `outbox_publisher::cli::OpsServer`):
//!
//! ```no_run
//! # #[allow(dead_code)]
//! # async fn f(pool: sqlx::PgPool, nats: async_nats::Client) {
//! let readiness = inbox_consumer::Readiness::new(pool, nats, "OUTBOX", "billing");
//! let report = readiness.check().await;
//! let status = if report.is_ready() { 200 } else { 503 };
//! println!("{status} {}", report.to_json());
//! # }
//! ```

use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream;
use outbox_pg::health::{self, Check, Report};
use sqlx::PgPool;

/// The default bound on each check: 2 s.
pub const DEFAULT_CHECK_TIMEOUT: Duration = health::DEFAULT_CHECK_TIMEOUT;

/// Checks a consumer's dependencies: `database`, `broker`, `stream` and
/// `consumer` (the durable).
#[derive(Debug, Clone)]
pub struct Readiness {
    pool: PgPool,
    js: jetstream::Context,
    stream: String,
    durable: String,
    timeout: Duration,
}

impl Readiness {
    /// Checks `pool`, `client`'s connection, and that `stream` and its
    /// durable consumer `durable` exist.
    pub fn new(
        pool: PgPool,
        client: async_nats::Client,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> Self {
        Self {
            pool,
            js: jetstream::new(client),
            stream: stream.into(),
            durable: durable.into(),
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
    /// connection is `Connected`, the stream exists and the durable consumer
    /// on it. What depends on a failed check is not asked for; its check says
    /// so.
    pub async fn check(&self) -> Report {
        let (database, broker) = tokio::join!(health::database(&self.pool, self.timeout), async {
            self.broker()
        });
        let mut report = Report::new().with(database);
        if !broker.ok() {
            return report
                .with(broker)
                .with(Check::failed(
                    "stream",
                    "not checked: the broker is not connected",
                ))
                .with(Check::failed(
                    "consumer",
                    "not checked: the broker is not connected",
                ));
        }
        report.push(broker);
        let stream =
            match tokio::time::timeout(self.timeout, self.js.get_stream(&self.stream)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    return report
                        .with(Check::failed("stream", stream_failure(&self.stream, &e)))
                        .with(Check::failed(
                            "consumer",
                            "not checked: the stream is not available",
                        ));
                }
                Err(_) => {
                    return report
                        .with(Check::failed(
                            "stream",
                            format!(
                                "JetStream did not answer about stream `{}` within {}",
                                self.stream,
                                outbox_pg::HumanDuration(self.timeout)
                            ),
                        ))
                        .with(Check::failed(
                            "consumer",
                            "not checked: the stream is not available",
                        ));
                }
            };
        report.push(Check::passed("stream"));
        let consumer =
            match tokio::time::timeout(self.timeout, stream.consumer_info(&self.durable)).await {
                Ok(Ok(_)) => Check::passed("consumer"),
                Ok(Err(e)) => Check::failed(
                    "consumer",
                    consumer_failure(&self.stream, &self.durable, &e),
                ),
                Err(_) => Check::failed(
                    "consumer",
                    format!(
                        "JetStream did not answer about durable consumer `{}` within {}",
                        self.durable,
                        outbox_pg::HumanDuration(self.timeout)
                    ),
                ),
            };
        report.with(consumer)
    }

    fn broker(&self) -> Check {
        match self.js.client().connection_state() {
            State::Connected => Check::passed("broker"),
            state => Check::failed("broker", format!("not connected to NATS (state: {state})")),
        }
    }
}

/// Why JetStream did not describe `stream`, in a few words, without the
/// client's error text.
fn stream_failure(stream: &str, error: &jetstream::context::GetStreamError) -> String {
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

/// Why JetStream did not describe the durable consumer, in a few words.
fn consumer_failure(
    stream: &str,
    durable: &str,
    error: &jetstream::context::ConsumerInfoError,
) -> String {
    use jetstream::context::ConsumerInfoErrorKind as Kind;
    match error.kind() {
        Kind::NotFound => {
            format!("durable consumer `{durable}` does not exist on stream `{stream}`")
        }
        Kind::StreamNotFound => format!("stream `{stream}` does not exist"),
        Kind::Offline => format!("durable consumer `{durable}` is offline"),
        Kind::InvalidName => format!("`{durable}` is not a valid consumer name"),
        Kind::TimedOut | Kind::NoResponders | Kind::Request => {
            format!("JetStream did not answer about durable consumer `{durable}`")
        }
        Kind::JetStream(e) => format!(
            "JetStream refused to describe durable consumer `{durable}` (error code {})",
            e.error_code().0
        ),
    }
}

impl outbox_pg::health::Probe for Readiness {
    fn check(&self) -> impl std::future::Future<Output = Report> + Send {
        Readiness::check(self)
    }
}
