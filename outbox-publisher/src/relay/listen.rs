//! Wake-ups: `LISTEN outbox_events`, so a committed event is claimed at once
//! instead of at the next poll. A lost connection is re-established with
//! backoff; whatever was notified meanwhile is caught by a wake-up on
//! reconnect and by polling.

use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::{NOTIFY_CHANNEL, Relay};
use crate::backoff::LoopBackoff;
use crate::sink::Sink;

impl<S: Sink> Relay<S> {
    pub(super) async fn listen_loop(
        &self,
        wake: &watch::Sender<u64>,
        shutdown: &CancellationToken,
    ) {
        if !self.config.listen {
            return;
        }
        let mut retry = LoopBackoff::new(Duration::from_millis(200), Duration::from_secs(10));
        let mut listener: Option<PgListener> = None;
        while !shutdown.is_cancelled() {
            let Some(active) = listener.as_mut() else {
                match PgListener::connect_with(self.store.pool()).await {
                    Ok(mut l) => match l.listen(NOTIFY_CHANNEL).await {
                        Ok(()) => {
                            retry.reset();
                            listener = Some(l);
                            // Anything committed while we were not listening.
                            wake.send_modify(|n| *n += 1);
                        }
                        Err(e) => debug!(error = %e, "LISTEN failed"),
                    },
                    Err(e) => debug!(error = %e, "LISTEN connection failed"),
                }
                if listener.is_none() {
                    tokio::select! {
                        () = tokio::time::sleep(retry.next()) => {}
                        () = shutdown.cancelled() => {}
                    }
                }
                continue;
            };
            tokio::select! {
                received = active.try_recv() => match received {
                    Ok(Some(_)) => wake.send_modify(|n| *n += 1),
                    // The connection was lost; notifications may have been missed.
                    Ok(None) => wake.send_modify(|n| *n += 1),
                    Err(e) => {
                        debug!(error = %e, "LISTEN connection lost");
                        listener = None;
                    }
                },
                () = shutdown.cancelled() => {}
            }
        }
    }
}
