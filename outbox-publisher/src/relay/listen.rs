//! Wake-ups: `LISTEN` on one of the outbox's channels, so a committed event
//! is claimed at once instead of at the next poll: the insert channel
//! (`outbox_events` for the table in `public`; see
//! [`outbox_pg::Namespace::notify_channel`] for the others), which the
//! polling source wakes on, or the due channel
//! ([`outbox_pg::Namespace::due_channel`]), on which the due lane hears of
//! newly scheduled rows. A lost connection is re-established with backoff;
//! whatever was notified meanwhile is caught by a wake-up on reconnect and
//! by polling.

use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::backoff::LoopBackoff;

/// Which of the outbox's channels to listen on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Channel {
    /// Every transaction that inserted rows.
    Inserts,
    /// Transactions that scheduled rows.
    Due,
}

/// Until `shutdown`, changes `wake` on every notification on the outbox's
/// `channel` (and on every reconnect), listening on connections made with
/// `pool`'s options.
pub(crate) async fn listen_loop(
    pool: &sqlx::PgPool,
    channel: Channel,
    wake: &watch::Sender<u64>,
    shutdown: &CancellationToken,
) {
    let mut retry = LoopBackoff::new(Duration::from_millis(200), Duration::from_secs(10));
    let mut listener: Option<PgListener> = None;
    while !shutdown.is_cancelled() {
        let Some(active) = listener.as_mut() else {
            match PgListener::connect_with(pool).await {
                Ok(mut l) => match listen(&mut l, channel).await {
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

/// Listens on `channel` of the outbox `listener`'s search_path leads to.
async fn listen(listener: &mut PgListener, channel: Channel) -> Result<(), String> {
    let namespace = outbox_pg::Namespace::of_table(&mut *listener, "outbox_events")
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "table outbox_events not found through the search_path".to_owned())?;
    let name = match channel {
        Channel::Inserts => namespace.notify_channel(),
        Channel::Due => namespace.due_channel(),
    };
    listener.listen(name).await.map_err(|e| e.to_string())
}
