//! The crate's error ([`outbox_pg::error::Error`] with this crate's
//! [`ErrorKind`]), and [`HandlerError`], a handler's failure with its
//! acknowledgement decision.

use std::fmt;
use std::time::Duration;

/// A boxed error: what tower layers return when they add a failure of their own.
pub use outbox_pg::BoxError;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, for matching. New kinds may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The consumer's configuration is unusable (for example an inbox retention
    /// window shorter than the redelivery window).
    Config,
    /// A message is not a CloudEvents 1.0 structured-mode JSON envelope with a
    /// valid id and attributes.
    InvalidEnvelope,
    /// An envelope's `data` does not decode as the handler's message type.
    Decode,
    /// No route for the event type.
    Unroutable,
    /// The database reported an error (the inbox insert, a commit, a dead letter).
    Database,
    /// NATS or JetStream reported an error (consumer set-up, fetch, ack, DLQ publish).
    Nats,
    /// The stream does not exist (yet), or JetStream did not answer when asked
    /// for it. Retrying may succeed: the stream's creator (often the relay)
    /// may start later, and the broker may come back.
    /// [`ConsumerBuilder`](crate::ConsumerBuilder) waits through it.
    StreamUnavailable,
    /// An ordered consumer's replica is no longer the leader: another replica
    /// took the lead, so this replica's transaction rolled back and its message
    /// is left for the new leader (neither acked nor nak'ed).
    LeaseLost,
    /// The consumer's database role lacks a privilege it needs (checked at
    /// start-up, or SQLSTATE `42501` later); the message names the role or
    /// the refused statement's object, and the group role of
    /// `ops/sql/roles.sql` that grants it (`outbox_consumer`).
    Privilege,
    /// The NATS client was closed under the consumer (drained, or its
    /// connection task ended): it will never deliver again, so the runtime
    /// stops instead of retrying on it. Build a new client and run again (the
    /// shipped binaries do), or exit non-zero and let a supervisor restart
    /// the process. Nothing is lost: what was not acked comes back.
    ClientClosed,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Config => "configuration error",
            Self::InvalidEnvelope => "invalid envelope",
            Self::Decode => "payload decode error",
            Self::Unroutable => "no route for event type",
            Self::Database => "database error",
            Self::Nats => "NATS error",
            Self::StreamUnavailable => "stream unavailable",
            Self::LeaseLost => "leadership lost",
            Self::Privilege => "insufficient privilege",
            Self::ClientClosed => "NATS client closed",
        })
    }
}

/// The error of every fallible call in this crate:
/// [`outbox_pg::error::Error`] with this crate's [`ErrorKind`].
///
/// Match on [`kind`](outbox_pg::error::Error::kind); the underlying cause,
/// where there is one, is the [`source`](std::error::Error::source).
pub type Error = outbox_pg::error::Error<ErrorKind>;

impl outbox_pg::error::Kind for ErrorKind {
    /// `42501` (insufficient privilege) is [`ErrorKind::Privilege`], with the
    /// grant that fixes it.
    fn database(insufficient_privilege: bool) -> (Self, Option<&'static str>) {
        if insufficient_privilege {
            (
                Self::Privilege,
                Some(
                    "the consumer's role needs the privileges of outbox_consumer, \
                     ops/sql/roles.sql",
                ),
            )
        } else {
            (Self::Database, None)
        }
    }

    /// A NATS error, or a database failure that is not the call's own (a
    /// serialization failure or deadlock, a lost connection, a server
    /// shutting down: [`outbox_pg::failure::is_transient`]).
    fn is_transient(self, source: Option<&(dyn std::error::Error + 'static)>) -> bool {
        match self {
            Self::Nats | Self::StreamUnavailable => true,
            Self::Database => source.is_some_and(outbox_pg::failure::is_transient),
            _ => false,
        }
    }
}

/// What the runtime does with a message whose handler failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Roll back and let JetStream redeliver: `AckKind::Nak(Some(delay))`. With no
    /// delay given, the runtime's retry policy picks one that grows with the
    /// delivery count. The last allowed delivery is dead-lettered instead.
    Retry {
        /// The delay the handler asked for, if any.
        after: Option<Duration>,
    },
    /// Roll back, dead-letter the message and terminate it (`AckKind::Term`):
    /// retrying cannot help.
    Reject,
}

/// A handler's failure, carrying the acknowledgement decision (retry with an
/// optional delay, or reject).
///
/// ```
/// use std::time::Duration;
/// use inbox_consumer::{Action, HandlerError};
///
/// let busy = HandlerError::retry("upstream busy").retry_after(Duration::from_secs(5));
/// assert_eq!(busy.action(), Action::Retry { after: Some(Duration::from_secs(5)) });
/// let bad = HandlerError::reject("plan `gold` does not exist");
/// assert_eq!(bad.action(), Action::Reject);
/// ```
///
/// `?` converts `sqlx::Error`, [`outbox_pg::Error`] and this crate's
/// [`Error`] into a retry (a schema violation or invalid envelope from
/// `outbox_pg` into a reject: retrying the same input cannot fix it).
#[derive(Debug)]
pub struct HandlerError {
    action: Action,
    source: BoxError,
}

impl HandlerError {
    /// A failure worth retrying; the runtime picks the delay.
    pub fn retry(error: impl Into<BoxError>) -> Self {
        Self {
            action: Action::Retry { after: None },
            source: error.into(),
        }
    }

    /// A failure that retrying cannot fix: dead-letter and terminate.
    pub fn reject(error: impl Into<BoxError>) -> Self {
        Self {
            action: Action::Reject,
            source: error.into(),
        }
    }

    /// Retry after `delay` instead of the runtime's backoff (turns a reject into a retry).
    #[must_use]
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.action = Action::Retry { after: Some(delay) };
        self
    }

    /// What the runtime does with the message.
    pub fn action(&self) -> Action {
        self.action
    }

    /// The underlying error.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self.source.as_ref()
    }

    /// Consumes the error, returning the underlying one.
    pub fn into_inner(self) -> BoxError {
        self.source
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.action {
            Action::Reject => write!(f, "handler rejected the event: {}", self.source),
            Action::Retry { .. } => write!(f, "handler failed: {}", self.source),
        }
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.source.as_ref())
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        Self::retry(e)
    }
}

impl From<outbox_pg::Error> for HandlerError {
    fn from(e: outbox_pg::Error) -> Self {
        use outbox_pg::ErrorKind as K;
        match e.kind() {
            K::InvalidEnvelope
            | K::UnknownEventType
            | K::SchemaViolation
            | K::InvalidSchema
            | K::Serialization => Self::reject(e),
            _ => Self::retry(e),
        }
    }
}

impl From<Error> for HandlerError {
    fn from(e: Error) -> Self {
        match e.kind() {
            ErrorKind::InvalidEnvelope | ErrorKind::Decode | ErrorKind::Unroutable => {
                Self::reject(e)
            }
            _ => Self::retry(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_sets_the_delay() {
        let e = HandlerError::retry("x");
        assert_eq!(e.action(), Action::Retry { after: None });
        let e = HandlerError::reject("x").retry_after(Duration::from_millis(5));
        assert_eq!(
            e.action(),
            Action::Retry {
                after: Some(Duration::from_millis(5))
            }
        );
    }

    #[test]
    fn the_kind_says_which_errors_a_retry_may_cure() {
        assert!(Error::new(ErrorKind::Nats, "down").is_transient());
        assert!(Error::new(ErrorKind::StreamUnavailable, "missing").is_transient());
        assert!(!Error::new(ErrorKind::Config, "bad").is_transient());
        assert!(!Error::new(ErrorKind::Decode, "bad").is_transient());
        assert!(Error::database("inserting", sqlx::Error::PoolTimedOut).is_transient());
        assert!(!Error::database("inserting", sqlx::Error::RowNotFound).is_transient());
        let e = Error::caused(ErrorKind::Nats, "acking", "connection closed");
        assert_eq!(e.to_string(), "acking: connection closed");
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn conversions_pick_the_action() {
        let e: HandlerError = Error::new(ErrorKind::Decode, "bad").into();
        assert_eq!(e.action(), Action::Reject);
        let e: HandlerError = Error::new(ErrorKind::Database, "down").into();
        assert!(matches!(e.action(), Action::Retry { .. }));
        let e: HandlerError = sqlx::Error::PoolTimedOut.into();
        assert!(matches!(e.action(), Action::Retry { .. }));
        assert!(e.to_string().contains("handler failed"));
    }
}
