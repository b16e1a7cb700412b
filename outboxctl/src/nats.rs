//! The NATS connection of the commands that publish or read the stream
//! (`dead-letters replay`, `audit`), with the binaries' own flags.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream;
use outbox_pg::connect::NatsArgs;

use crate::error::{Error, ErrorKind, Result};

/// Connects with `nats` (every URL of `--nats-url`), bounded by `timeout`,
/// which also bounds each JetStream request.
///
/// # Errors
/// [`ErrorKind::Nats`] naming the (redacted) URL and the cause;
/// [`ErrorKind::Config`] for flags that do not go together.
pub(crate) async fn jetstream(nats: &NatsArgs, timeout: Duration) -> Result<jetstream::Context> {
    let shown = nats.redacted_url();
    let urls = nats.server_urls()?;
    let options = nats.connect_options("outboxctl").await?;
    let client = tokio::time::timeout(timeout, options.connect(urls))
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::Nats,
                format!(
                    "connecting to NATS at {shown}: no answer in {}",
                    humantime::format_duration(timeout)
                ),
            )
        })?
        .map_err(|e| {
            Error::new(
                ErrorKind::Nats,
                format!("connecting to NATS at {shown}: {e}"),
            )
        })?;
    let mut js = jetstream::new(client);
    js.set_timeout(timeout);
    Ok(js)
}

/// `work` on a client of `nats`, unless the server refuses its user
/// something first (a permissions violation: the request would only time
/// out): then an error naming the subject and the permission to add it to.
///
/// # Errors
/// `work`'s; [`ErrorKind::Nats`] for a permissions violation.
pub(crate) async fn unless_denied<T>(
    nats: &NatsArgs,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::select! {
        done = work => done,
        denied = nats.permission_denied() => Err(denied.into()),
    }
}
