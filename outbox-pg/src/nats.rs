//! The NATS client as the runtimes see it (feature `nats`).
//!
//! async-nats reconnects by itself after a lost connection, so a
//! disconnected client is a state to wait in. A *closed* client is not: its
//! connection task has ended (the client was drained, or the task stopped on
//! a fault of its own), every command fails at once, and nothing will bring
//! it back. Retrying on such a handle is a loop that logs for ever; the
//! consumer runtime and the relay return an error of their own instead
//! (`ClientClosed`), and the binaries build a new client from their flags.

/// Whether `client` is closed for good: its connection task has ended
/// (the client was drained, or the task stopped), so every command fails at
/// once and no reconnect will follow. A client that is only disconnected,
/// and reconnecting, is not closed. Answers at once.
///
/// A closed client is a fault to recover from by building a new one, never
/// a state to retry in: `inbox_consumer::Consumer::run` and
/// `outbox_publisher::Relay::run` return an error of their own kind
/// (`ClientClosed`) when they find theirs closed.
pub fn is_closed(client: &async_nats::Client) -> bool {
    use futures::FutureExt as _;
    // A flush first sends a command to the connection task: on a closed
    // channel that fails before the first await returns.
    matches!(
        client.flush().now_or_never(),
        Some(Err(e)) if e.kind() == async_nats::client::FlushErrorKind::SendError
    )
}
