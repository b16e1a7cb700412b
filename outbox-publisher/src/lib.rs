//! The outbox relay: moves committed events from `outbox_events` to NATS
//! JetStream, at least once, in order per subject, across any number of
//! replicas, and the `outbox-relay` binary that runs it.
//!
//! # Getting started
//!
//! ```no_run
//! use outbox_publisher::{Relay, RelayConfig, StreamSpec};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
//! outbox_pg::migrate(&pool).await?;
//! let nats = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let stream = StreamSpec::new("OUTBOX", vec!["subscription.>".into()]);
//! let relay = Relay::jetstream(pool, nats, &stream, RelayConfig::default()).await?;
//!
//! // SIGTERM or ctrl-c: finish the current batch, then return.
//! relay.run(outbox_publisher::shutdown_signal()).await?;
//! # Ok(()) }
//! ```
//!
//! # Guarantees
//!
//! - **At least once.** `published_at` is set only from a JetStream PubAck (an
//!   ack flagged duplicate counts). A relay killed between publish and mark
//!   republishes with the same `Nats-Msg-Id`, which the stream's duplicate
//!   window drops; consumers dedupe on the event id for the rest.
//! - **Ordered per subject, in insert order.** Rows are published per envelope
//!   `subject` in `seq` order (assigned at insert), as a gap-free prefix, by
//!   the one relay that owns the subject's shard; the order travels as the
//!   CloudEvents `sequence` attribute. Different subjects flow in parallel.
//!   See [`relay`]'s design notes.
//! - **Cost independent of what was published.** Each shard is read from a
//!   cursor that only passes settled seqs, so dead tuples of published rows are
//!   not read again, even while an old snapshot pins the vacuum horizon.
//! - **No lock across the network.** A batch is read by one statement that
//!   writes nothing; publishing happens outside any transaction, each publish
//!   bounded by a timeout.
//! - **Broker faults cost no attempts; no row can stop the relay.** Every
//!   column is checked before publishing; a row that can never be published is
//!   parked with an error naming the fault and blocks only its own subject.
//! - **Bounded retries.** Exponential backoff with jitter per row (1 s, 2 s, 4 s,
//!   … capped at 5 min) and an attempt cap (20) past which a row is left alone,
//!   logged at error level and counted.
//! - **Retention** deletes only published rows older than the window.
//! - **Acknowledged, then lost: published again.** Each row keeps its
//!   PubAck's stream and sequence; the [`audit`] reads published rows'
//!   messages back and republishes, once and with the same id, a row whose
//!   message the stream lost after acking it. The durability in force
//!   (replicas, storage, duplicate window against lease + publish timeout,
//!   the audit) is logged at start, risky settings warned on or, with
//!   [`RelayConfig::require_durable`], refused.
//!
//! # Sources
//!
//! By default the relay claims new rows from the table ([`Source::Poll`]);
//! [`RelayConfig::source_wal`] reads them from PostgreSQL's logical decoding
//! instead, in commit order, with the same guarantees (see [`wal`]).
//!
//! # Features
//!
//! - `cli` (off by default): the `outbox-relay` binary and the helpers
//!   binaries share (`cli`: database and NATS flags with secrets from env or
//!   files, logging, signal shutdown; PostgreSQL TLS through sqlx's rustls
//!   backend; `cli::OpsServer`, the `/metrics`, `/healthz` and `/readyz`
//!   endpoint), with clap, axum,
//!   the Prometheus exporter and tracing-subscriber. A library user's build
//!   compiles none of them; [`Readiness`] (the checks behind `/readyz`) is
//!   in the default build, for a service's own server. `cargo install outbox-publisher --features cli,opentelemetry`
//!   installs the binary.
//! - `opentelemetry` (off; implies `cli`): the binaries' OTLP span exporter,
//!   `--otlp-endpoint` / `OTEL_EXPORTER_OTLP_ENDPOINT` (`cli::TelemetryArgs`):
//!   `tracing` spans exported over OTLP/HTTP (protobuf), batched, flushed at
//!   exit; and `outbox-pg/opentelemetry`, so events written in a span carry
//!   its trace. The relay itself forwards each row's `traceparent` and
//!   `tracestate` as message headers in every build.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(warnings))))]

pub mod audit;
mod backoff;
#[cfg(feature = "cli")]
pub mod cli;
mod config;
mod error;
mod health;
/// The user guide's chapters on running the relay, rendered here from the
/// repository's `docs/`.
pub mod guide {
    #[doc = include_str!("../docs/relay.md")]
    pub mod relay {}
    #[doc = include_str!("../docs/operations.md")]
    pub mod operations {}
    #[doc = include_str!("../docs/alerts.md")]
    pub mod alerts {}
    #[doc = include_str!("../docs/cluster.md")]
    pub mod cluster {}
}
pub mod metrics;
pub mod relay;
mod sink;
mod store;
mod stream;
mod stream_view;
pub mod wal;

pub use config::{BATCH_SIZE_RANGE, RelayConfig, Source};
pub use error::{BoxError, Error, ErrorKind, Result};
pub use health::{DEFAULT_CHECK_TIMEOUT, Readiness};
/// Resolves on SIGTERM or ctrl-c: the `shutdown` to give [`Relay::run`] (or
/// [`Relay::run_jetstream`]) for a relay run in-process.
pub use outbox_pg::shutdown_signal;
pub use relay::{BatchReport, NOTIFY_CHANNEL, Relay, required_privileges};
pub use sink::{
    DEFAULT_MAX_PAYLOAD, FailureKind, JetStreamSink, MAX_BATCH, OutgoingMessage, PublishAck,
    PublishFailure, Sink,
};
pub use stream::{DEFAULT_DUPLICATE_WINDOW, StreamSpec};
pub use stream_view::StreamView;
pub use wal::WalSource;

pub use async_nats::jetstream::stream::StorageType;

/// The crate README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
