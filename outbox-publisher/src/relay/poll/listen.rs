//! Wake-ups: `LISTEN` on the outbox's channel (`outbox_events` for the table
//! in `public`; see [`outbox_pg::Namespace::notify_channel`] for the others),
//! so a committed event is claimed at once instead of at the next poll. A lost connection is re-established with
//! backoff; whatever was notified meanwhile is caught by a wake-up on
//! reconnect and by polling.

use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::backoff::LoopBackoff;

/// Until `shutdown`, changes `wake` on every notification on the outbox's
/// channel (and on every reconnect), listening on connections made with
/// `pool`'s options.
pub(crate) async fn listen_loop(
    pool: &sqlx::PgPool,
    wake: &watch::Sender<u64>,
    shutdown: &CancellationToken,
) {
    let mut retry = LoopBackoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let mut listener: Option<PgListener> = None;
    while !shutdown.is_cancelled() {
        let Some(active) = listener.as_mut() else {
            match PgListener::connect_with(pool).await {
                Ok(mut l) => match listen(&mut l).await {
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

/// Listens on the channel of the outbox `listener`'s search_path leads to.
async fn listen(listener: &mut PgListener) -> Result<(), String> {
    let namespace = outbox_pg::Namespace::of_table(&mut *listener, "outbox_events")
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "table outbox_events not found through the search_path".to_owned())?;
    listener
        .listen(namespace.notify_channel())
        .await
        .map_err(|e| e.to_string())
}
