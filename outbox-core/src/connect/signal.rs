//! Shutdown on SIGTERM or ctrl-c.

use tokio_util::sync::CancellationToken;

/// Waits for SIGTERM or ctrl-c, logs `what` is shutting down, and cancels
/// `shutdown`. Spawn it beside the work it stops.
///
/// If SIGTERM cannot be listened for (it is logged), ctrl-c alone stops.
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
