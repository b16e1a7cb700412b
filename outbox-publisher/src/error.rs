//! The crate's one error type.

use std::fmt;

/// A boxed error, as kept in [`Error::source`](std::error::Error::source).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

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
        })
    }
}

/// The error of every fallible call in this crate.
///
/// Per-row publish failures are not errors of the relay: they are recorded on
/// the row (`attempts`, `last_error`) and the relay goes on.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<BoxError>,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    pub(crate) fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// A database error; `42501` (insufficient privilege) is
    /// [`ErrorKind::Privilege`], with the grant that fixes it.
    pub(crate) fn database(context: &str, source: sqlx::Error) -> Self {
        if outbox_pg::is_insufficient_privilege(&source) {
            return Self::new(
                ErrorKind::Privilege,
                format!(
                    "{context}: {source} (the relay's role needs the privileges of \
                     outbox_relay, ops/sql/roles.sql)"
                ),
            )
            .with_source(source);
        }
        Self::new(ErrorKind::Database, format!("{context}: {source}")).with_source(source)
    }

    /// What kind of error this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Whether the same call may succeed later (the broker, a lost
    /// connection, a server shutting down, a serialization failure:
    /// [`outbox_pg::failure::is_transient`]), as opposed to a configuration
    /// problem.
    pub fn is_transient(&self) -> bool {
        match self.kind {
            ErrorKind::Broker => true,
            ErrorKind::Database => self
                .source
                .as_deref()
                .is_some_and(|source| outbox_pg::failure::is_transient(source)),
            _ => false,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<outbox_pg::Error> for Error {
    fn from(e: outbox_pg::Error) -> Self {
        let kind = match e.kind() {
            outbox_pg::ErrorKind::Database => ErrorKind::Database,
            outbox_pg::ErrorKind::Broker => ErrorKind::Broker,
            outbox_pg::ErrorKind::Privilege => ErrorKind::Privilege,
            _ => ErrorKind::Config,
        };
        Self::new(kind, e.to_string()).with_source(e)
    }
}
