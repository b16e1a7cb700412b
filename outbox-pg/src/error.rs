//! The error type of the outbox crates: one [`Error`], generic over the kind
//! each crate matches on, as async-nats' `Error<Kind>`.
//!
//! This crate's errors are `Error<ErrorKind>` (plain [`Error`]); the relay's
//! are `outbox_publisher::Error`, an alias of `Error<outbox_publisher::ErrorKind>`,
//! and the consumer's `inbox_consumer::Error` likewise. All of them have a
//! [`kind`](Error::kind) to match on, a one-line message and the cause as
//! [`source`](std::error::Error::source), and say whether a retry may succeed
//! ([`is_transient`](Error::is_transient)) through one classifier,
//! [`failure`](crate::failure).
//!
//! ```
//! use outbox_pg::{Envelope, ErrorKind};
//!
//! let err = Envelope::new("Not A Type", "billing", "sub-1", serde_json::json!({})).unwrap_err();
//! assert_eq!(err.kind(), ErrorKind::InvalidEnvelope);
//! assert!(!err.is_transient());
//! ```

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

/// What a crate's error kind says about its errors: which kind a failed
/// statement is, and which kinds a retry may cure. Implemented by each crate's
/// `ErrorKind`.
pub trait Kind: Copy + fmt::Debug + fmt::Display + PartialEq + Send + Sync + 'static {
    /// The kind of a failed database statement, and the words added to its
    /// message. `insufficient_privilege` is SQLSTATE `42501`: a crate that
    /// checks its role's grants returns its privilege kind and the group role
    /// that grants them.
    fn database(insufficient_privilege: bool) -> (Self, Option<&'static str>);

    /// Whether an error of this kind, caused by `source`, may succeed if the
    /// same call is made again. A database failure is transient as
    /// [`failure::is_transient`](crate::failure::is_transient) says.
    fn is_transient(self, source: Option<&(dyn std::error::Error + 'static)>) -> bool;
}

/// A kind that this crate's errors convert into (`?` from a call of
/// `outbox_pg` in another crate).
pub trait FromCore: Kind {
    /// The kind an `outbox_pg` error of `kind` becomes.
    fn from_core(kind: ErrorKind) -> Self;
}

impl Kind for ErrorKind {
    fn database(_insufficient_privilege: bool) -> (Self, Option<&'static str>) {
        (Self::Database, None)
    }

    fn is_transient(self, source: Option<&(dyn std::error::Error + 'static)>) -> bool {
        source.is_some_and(crate::failure::is_transient)
    }
}

/// An error of the outbox crates: a kind `K` to match on, a message, and the
/// underlying cause. This crate's is `Error<ErrorKind>`, written [`Error`].
///
/// Match on [`Error::kind`]; the underlying cause, where there is one, is the
/// [`source`](std::error::Error::source).
#[derive(Debug)]
pub struct Error<K = ErrorKind> {
    inner: Box<Inner<K>>,
}

#[derive(Debug)]
struct Inner<K> {
    kind: K,
    message: String,
    event_type: Option<String>,
    violations: Vec<Violation>,
    source: Option<BoxError>,
}

impl<K: Kind> Error<K> {
    /// An error of `kind` saying `message`.
    pub fn new(kind: K, message: impl Into<String>) -> Self {
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

    /// An error of `kind` caused by `source`: `"{context}: {source}"`.
    pub fn caused(kind: K, context: impl fmt::Display, source: impl Into<BoxError>) -> Self {
        let source = source.into();
        let text = crate::human::error_text(&*source);
        Self::new(kind, format!("{context}: {text}")).with_source(source)
    }

    /// A failed statement, `context` saying what it was for: the kind
    /// [`Kind::database`] gives (SQLSTATE `42501` a privilege error where the
    /// crate has one, naming the grant that fixes it).
    pub fn database(context: &str, source: sqlx::Error) -> Self {
        let (kind, hint) = K::database(crate::is_insufficient_privilege(&source));
        let text = crate::db_error_text(&source);
        let message = match hint {
            Some(hint) => format!("{context}: {text} ({hint})"),
            None => format!("{context}: {text}"),
        };
        Self::new(kind, message).with_source(source)
    }

    /// The same error, caused by `source`.
    #[must_use]
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.inner.source = Some(source.into());
        self
    }

    /// Prefixes the message with what it is about: `"{context}: {message}"`.
    #[must_use]
    pub fn context(mut self, context: impl fmt::Display) -> Self {
        self.inner.message = format!("{context}: {}", self.inner.message);
        self
    }

    /// What kind of error this is.
    pub fn kind(&self) -> K {
        self.inner.kind
    }

    /// Whether retrying the same call may succeed: a serialization failure or
    /// deadlock, a lost connection, a server shutting down
    /// ([`failure::is_transient`](crate::failure::is_transient)), and for the
    /// relay and the consumer, the broker.
    pub fn is_transient(&self) -> bool {
        self.inner.kind.is_transient(
            self.inner
                .source
                .as_deref()
                .map(|e| e as &(dyn std::error::Error + 'static)),
        )
    }
}

impl Error<ErrorKind> {
    pub(crate) fn with_event_type(mut self, event_type: impl Into<String>) -> Self {
        self.inner.event_type = Some(event_type.into());
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

    /// The event type the error is about, where there is one.
    pub fn event_type(&self) -> Option<&str> {
        self.inner.event_type.as_deref()
    }

    /// For [`ErrorKind::SchemaViolation`]: every way the payload failed its schema.
    pub fn violations(&self) -> &[Violation] {
        &self.inner.violations
    }
}

/// `?` from `outbox_pg` in a crate whose kind is [`FromCore`]: the kind
/// converted, the message kept, the `outbox_pg` error the source.
impl<K: FromCore> From<Error<ErrorKind>> for Error<K> {
    fn from(e: Error<ErrorKind>) -> Self {
        Self::new(K::from_core(e.kind()), e.to_string()).with_source(e)
    }
}

impl<K> fmt::Display for Error<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.inner.message)
    }
}

impl<K: fmt::Debug> std::error::Error for Error<K> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner
            .source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}
