//! The crate's error: [`outbox_pg::error::Error`] with this crate's
//! [`ErrorKind`].

use std::fmt;

pub use outbox_pg::BoxError;

/// The error of every fallible call in this crate: match on
/// [`kind`](outbox_pg::error::Error::kind); the underlying cause, where there
/// is one, is the [`source`](std::error::Error::source).
///
/// Per-row publish failures are not errors of the relay: they are recorded on
/// the row (`attempts`, `last_error`) and the relay goes on.
pub type Error = outbox_pg::error::Error<ErrorKind>;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, for matching. New kinds may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The configuration is invalid (a value out of range, a missing setting).
    Config,
    /// The database reported an error.
    Database,
    /// The broker could not be reached or refused the connection.
    Broker,
    /// The JetStream stream is missing, could not be created, or differs from
    /// the configuration.
    Stream,
    /// The relay's database role lacks a privilege it needs (checked at
    /// start-up, or SQLSTATE `42501` later); the message names the role or
    /// the refused statement's object, and the group role of
    /// `ops/sql/roles.sql` that grants it (`outbox_relay`).
    Privilege,
    /// A drain ([`Relay::drain`](crate::Relay::drain), `outbox-relay --once`)
    /// gave up on rows left in other relays' shards: none of them was
    /// published for a minute. The message counts them and names the shards.
    Stalled,
    /// The NATS client was closed under the relay (drained, or its
    /// connection task ended): nothing can be published on it again, so the
    /// relay stops instead of retrying on it. Build a new client and run
    /// again (`outbox-relay` does), or exit non-zero and let a supervisor
    /// restart the process. Nothing is lost: unmarked rows stay in the table.
    ClientClosed,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Config => "configuration error",
            Self::Database => "database error",
            Self::Broker => "broker error",
            Self::Stream => "stream error",
            Self::Privilege => "insufficient privilege",
            Self::Stalled => "stalled",
            Self::ClientClosed => "NATS client closed",
        })
    }
}

impl outbox_pg::error::Kind for ErrorKind {
    /// `42501` (insufficient privilege) is [`ErrorKind::Privilege`], with the
    /// grant that fixes it.
    fn database(insufficient_privilege: bool) -> (Self, Option<&'static str>) {
        if insufficient_privilege {
            (
                Self::Privilege,
                Some("the relay's role needs the privileges of outbox_relay, ops/sql/roles.sql"),
            )
        } else {
            (Self::Database, None)
        }
    }

    /// The broker, a lost connection, a server shutting down, a
    /// serialization failure ([`outbox_pg::failure::is_transient`]), as
    /// opposed to a configuration problem.
    fn is_transient(self, source: Option<&(dyn std::error::Error + 'static)>) -> bool {
        match self {
            Self::Broker => true,
            Self::Database => source.is_some_and(outbox_pg::failure::is_transient),
            _ => false,
        }
    }
}

impl outbox_pg::error::FromCore for ErrorKind {
    fn from_core(kind: outbox_pg::ErrorKind) -> Self {
        match kind {
            outbox_pg::ErrorKind::Database => Self::Database,
            outbox_pg::ErrorKind::Broker => Self::Broker,
            outbox_pg::ErrorKind::Privilege => Self::Privilege,
            _ => Self::Config,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> sqlx::Error {
        sqlx::Error::Protocol("42501 stand-in: not a database error".into())
    }

    #[test]
    fn the_kind_says_which_errors_a_retry_may_cure() {
        assert!(Error::new(ErrorKind::Broker, "down").is_transient());
        assert!(!Error::new(ErrorKind::Config, "bad").is_transient());
        assert!(!Error::new(ErrorKind::Stream, "differs").is_transient());
        // A database error is as transient as its cause.
        assert!(Error::database("reading", sqlx::Error::PoolTimedOut).is_transient());
        assert!(!Error::database("reading", sqlx::Error::RowNotFound).is_transient());
        let e = Error::database("reading", refused());
        assert_eq!(e.kind(), ErrorKind::Database);
        assert_eq!(e.to_string(), format!("reading: {}", refused()));
    }

    #[test]
    fn an_outbox_pg_error_keeps_its_message_and_maps_its_kind() {
        fn relay_call() -> Result<()> {
            let core: outbox_pg::Result<()> = Err(outbox_pg::Error::new(
                outbox_pg::ErrorKind::Broker,
                "no route",
            ));
            core?;
            Ok(())
        }
        let e = relay_call().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Broker);
        assert_eq!(e.to_string(), "no route");
        let source =
            std::error::Error::source(&e).and_then(|s| s.downcast_ref::<outbox_pg::Error>());
        assert_eq!(
            source.map(outbox_pg::Error::kind),
            Some(outbox_pg::ErrorKind::Broker)
        );
        let e: Error = outbox_pg::Error::new(outbox_pg::ErrorKind::SchemaViolation, "x").into();
        assert_eq!(e.kind(), ErrorKind::Config);
    }
}
