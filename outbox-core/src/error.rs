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
    /// An envelope attribute is invalid (event type, source, subject, id, spec
    /// version, time, trace context, sequence), the payload is JSON consumers
    /// cannot decode, or a message is not a CloudEvents 1.0 structured-mode JSON
    /// envelope.
    InvalidEnvelope,
    /// No schema is registered for the event type.
    UnknownEventType,
    /// The payload does not satisfy its event type's JSON Schema.
    SchemaViolation,
    /// A schema file could not be read or compiled.
    InvalidSchema,
    /// A payload could not be encoded to or decoded from JSON.
    Serialization,
    /// The database reported an error.
    Database,
    /// An event's message, its CloudEvents JSON plus NATS headers, is larger
    /// than the outbox's maximum message size.
    TooLarge,
    /// A connection setting is invalid: a flag missing its pair, a secret
    /// file that cannot be read, a URL that does not parse (feature
    /// `connect`).
    Config,
    /// NATS could not be reached or refused the connection: wrong
    /// credentials, a TLS failure (feature `connect`).
    Broker,
    /// The database role lacks a privilege it needs (SQLSTATE `42501`), or
    /// may not change a schema that is not up to date; the message names the
    /// role, the privilege and the object.
    Privilege,
    /// The outbox's schema is missing or not complete where the search_path
    /// leads (a table, a column, a trigger): the migrations have not run
    /// there, or not all of them. The message says what to run.
    Schema,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InvalidEnvelope => "invalid envelope",
            Self::UnknownEventType => "unknown event type",
            Self::SchemaViolation => "schema violation",
            Self::InvalidSchema => "invalid schema",
            Self::Serialization => "serialization error",
            Self::Database => "database error",
            Self::TooLarge => "message too large",
            Self::Config => "configuration error",
            Self::Broker => "broker error",
            Self::Privilege => "insufficient privilege",
            Self::Schema => "outbox schema missing",
        })
    }
}

/// One way a payload fails its schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// JSON pointer into the payload (`""` is the payload itself).
    pub instance_path: String,
    /// JSON pointer into the schema, to the keyword that failed.
    pub schema_path: String,
    /// Why it failed.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = if self.instance_path.is_empty() {
            "/"
        } else {
            &self.instance_path
        };
        write!(f, "at {path}: {}", self.message)
    }
}

/// The error of every fallible call in this crate.
///
/// Match on [`Error::kind`]; the underlying cause, where there is one, is the
/// [`source`](std::error::Error::source).
#[derive(Debug)]
pub struct Error {
    inner: Box<Inner>,
}

#[derive(Debug)]
struct Inner {
    kind: ErrorKind,
    message: String,
    event_type: Option<String>,
    violations: Vec<Violation>,
    source: Option<BoxError>,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            inner: Box::new(Inner {
                kind,
                message: message.into(),
                event_type: None,
                violations: Vec::new(),
                source: None,
            }),
        }
    }

    pub(crate) fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.inner.source = Some(source.into());
        self
    }

    pub(crate) fn with_event_type(mut self, event_type: impl Into<String>) -> Self {
        self.inner.event_type = Some(event_type.into());
        self
    }

    /// Prefixes the message with what it is about: `"{context}: {message}"`.
    pub(crate) fn context(mut self, context: impl fmt::Display) -> Self {
        self.inner.message = format!("{context}: {}", self.inner.message);
        self
    }

    pub(crate) fn schema_violation(event_type: &str, violations: Vec<Violation>) -> Self {
        let details = violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        let mut err = Self::new(
            ErrorKind::SchemaViolation,
            format!("payload of event type `{event_type}` violates its schema: {details}"),
        )
        .with_event_type(event_type);
        err.inner.violations = violations;
        err
    }

    pub(crate) fn database(context: &str, source: sqlx::Error) -> Self {
        Self::new(ErrorKind::Database, format!("{context}: {source}")).with_source(source)
    }

    /// What kind of error this is.
    pub fn kind(&self) -> ErrorKind {
        self.inner.kind
    }

    /// The event type the error is about, where there is one.
    pub fn event_type(&self) -> Option<&str> {
        self.inner.event_type.as_deref()
    }

    /// For [`ErrorKind::SchemaViolation`]: every way the payload failed its schema.
    pub fn violations(&self) -> &[Violation] {
        &self.inner.violations
    }

    /// Whether retrying the same call may succeed: a serialization failure or
    /// deadlock, a lost connection, a server shutting down
    /// ([`failure::is_transient`](crate::failure::is_transient)).
    pub fn is_transient(&self) -> bool {
        self.inner
            .source
            .as_deref()
            .is_some_and(|source| crate::failure::is_transient(source))
    }
}

/// The SQLSTATE of the first database error (`sqlx::Error::Database`) in
/// `error`'s `source` chain, `error` itself included.
pub fn sqlstate(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if let Some(sqlx::Error::Database(db)) = e.downcast_ref::<sqlx::Error>() {
            return db.code().map(|code| code.into_owned());
        }
        cause = e.source();
    }
    None
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.inner.message)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner
            .source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}
