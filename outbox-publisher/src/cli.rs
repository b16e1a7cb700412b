//! What the `outbox-relay` binary and services that embed a relay share:
//! log set-up, the metrics and health endpoint ([`OpsServer`]), and (re-exported from [`outbox_pg::connect`], where consumer
//! services find them too) the PostgreSQL and NATS connection flags, secrets
//! and shutdown on a signal.

mod ops;

pub use ops::{
    LateReadiness, OpsServer, ROWS_BUCKETS, SECONDS_BUCKETS, install_prometheus, parse_ops_addr,
    serve_ops,
};
pub use outbox_pg::connect::{DatabaseArgs, NatsArgs, Secret, cancel_on_signal, redact_url};

/// How logs are written (to stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Human,
    /// One JSON object per line, fields flattened.
    Json,
}

/// Installs a `tracing` subscriber writing to stderr, filtered by `RUST_LOG`
/// (default `info`). Colours only on a terminal.
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
