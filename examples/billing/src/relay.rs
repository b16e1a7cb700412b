//! The in-process relay: this service's outbox, published to JetStream.
//!
//! The HTTP API does not need the broker (events wait in `outbox_events`), so
//! the relay starts in the background and keeps trying until NATS answers.

use std::time::Duration;

use outbox_publisher::{Relay, RelayConfig, StreamSpec};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// First and longest pause between attempts to set the relay up.
const RETRY: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(10));

/// Sets up a JetStream relay for `stream` (creating the stream if missing)
/// and runs it until `shutdown` is cancelled. Set-up failures (NATS not
/// reachable yet) are logged and retried with backoff; a stream that differs
/// from `stream` is retried too, loudly, since an operator must fix it.
pub async fn run_relay(
    pool: PgPool,
    nats: async_nats::Client,
    stream: StreamSpec,
    config: RelayConfig,
    shutdown: CancellationToken,
) {
    let mut pause = RETRY.0;
    let relay = loop {
        let attempt = Relay::jetstream(pool.clone(), nats.clone(), &stream, config.clone());
        let result = tokio::select! {
            () = shutdown.cancelled() => return,
            result = attempt => result,
        };
        match result {
            Ok(relay) => break relay,
            Err(e) => {
                tracing::warn!(stream = stream.name(), error = %e, retry_in = ?pause, "relay set-up failed; retrying");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(RETRY.1);
            }
        }
    };
    tracing::info!(stream = stream.name(), "relay running");
    if let Err(e) = relay.run(shutdown).await {
        tracing::error!(error = %e, "relay stopped with an error");
    }
}
