//! Shutdown on SIGTERM or ctrl-c, for any binary (no `connect` feature).
//!
//! Containers stop a process with SIGTERM (Docker, Kubernetes), a terminal
//! with ctrl-c: a service that waits for ctrl-c alone is killed at the end
//! of the grace period, its in-flight work cut off instead of drained.

/// Resolves on SIGTERM or ctrl-c, whichever comes first. Pass it where a
/// runtime takes its shutdown future (`Consumer::run(service, shutdown_signal())`),
/// or cancel a token with it (`Relay::run` takes a `CancellationToken`):
///
/// ```no_run
/// # #[tokio::main]
/// # async fn main() {
/// outbox_pg::shutdown_signal().await;
/// println!("draining, then exiting");
/// # }
/// ```
///
/// If SIGTERM cannot be listened for (logged as an error), ctrl-c alone
/// resolves it; if neither can, it never resolves (also logged).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    () = ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM; ctrl-c only");
                ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    ctrl_c().await;
}

async fn ctrl_c() {
    if let Err(e) = tokio::signal::ctrl_c().await {
        tracing::error!(error = %e, "cannot listen for ctrl-c");
        std::future::pending::<()>().await;
    }
}
