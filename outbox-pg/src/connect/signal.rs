//! Shutdown on SIGTERM or ctrl-c.

use tokio_util::sync::CancellationToken;

/// Waits for SIGTERM or ctrl-c ([`shutdown_signal`](crate::shutdown_signal)),
/// logs `what` is shutting down, and cancels `shutdown`. Spawn it beside the
/// work it stops.
pub async fn cancel_on_signal(shutdown: CancellationToken, what: &'static str) {
    crate::shutdown_signal().await;
    tracing::info!("shutting down: {what}");
    shutdown.cancel();
}
