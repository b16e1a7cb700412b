//! What the `outbox-relay` binary and services that embed a relay share:
//! the relay's flags, each group building its part of the relay's
//! configuration ([`StreamArgs`]: the stream; [`RelayArgs`]: batches,
//! retries, retention, the audit; [`SourceArgs`]: polling or the WAL), logs
//! and traces ([`TelemetryArgs`]: `--log-format`, and with the
//! `opentelemetry` feature the OTLP span exporter switch `--otlp-endpoint`),
//! the metrics and health endpoint ([`OpsServer`]), and (re-exported from
//! [`outbox_pg::connect`], where consumer services find them too) the
//! PostgreSQL and NATS connection flags, secrets and shutdown on a signal.

mod ops;
#[cfg(feature = "opentelemetry")]
mod otlp;
mod relay;
mod source;
mod stream;
mod telemetry;

pub use ops::{
    LateReadiness, OpsServer, ROWS_BUCKETS, SECONDS_BUCKETS, install_prometheus, parse_ops_addr,
    serve_ops,
};
pub use outbox_pg::connect::{
    DatabaseArgs, ExposeSecret, NatsArgs, Secret, cancel_on_signal, redact_url,
};
pub use relay::RelayArgs;
pub use source::SourceArgs;
pub use stream::StreamArgs;
pub use telemetry::{LogFormat, Telemetry, TelemetryArgs, init_logging};
