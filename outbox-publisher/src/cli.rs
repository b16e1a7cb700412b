//! What the `outbox-relay` binary and services that embed a relay share:
//! log set-up and shutdown on a signal.

use tokio_util::sync::CancellationToken;

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

/// Waits for SIGTERM or ctrl-c, logs `what` is shutting down, and cancels
/// `shutdown`. Spawn it beside the work it stops.
pub async fn cancel_on_signal(shutdown: CancellationToken, what: &'static str) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM; ctrl-c only");
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
    tracing::info!("shutting down: {what}");
    shutdown.cancel();
}
