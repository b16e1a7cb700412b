//! The one error type of `outboxctl`: a kind to match on and a message that
//! names what was wrong, printed as one line.

use std::fmt;

/// What went wrong, for the exit code and the `--json` error object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum ErrorKind {
    /// A flag or its value is wrong, or a required one is missing.
    Config,
    /// The database cannot be reached or refused the connection.
    Connect,
    /// A table the command reads is not in the database (not migrated).
    MissingTable,
    /// An id given on the command line names no row.
    NotFound,
    /// The row exists but the command cannot act on it as it is.
    InvalidState,
    /// A statement failed.
    Database,
    /// NATS could not be reached, or refused a publish.
    Nats,
    /// Writing the output failed.
    Io,
}

impl ErrorKind {
    /// A stable code for `--json`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Config => "config",
            Self::Connect => "connect",
            Self::MissingTable => "missing_table",
            Self::NotFound => "not_found",
            Self::InvalidState => "invalid_state",
            Self::Database => "database",
            Self::Nats => "nats",
            Self::Io => "io",
        }
    }
}

/// An error with its kind; `Display` is one line.
#[derive(Debug)]
pub(crate) struct Error {
    kind: ErrorKind,
    message: String,
}

/// `Result` with [`Error`].
pub(crate) type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// A failed statement, `context` saying what it was for. A missing table
    /// (SQLSTATE 42P01) is [`ErrorKind::MissingTable`].
    pub(crate) fn database(context: &str, e: sqlx::Error) -> Self {
        let kind = match e.as_database_error().and_then(|d| d.code()) {
            Some(code) if code == "42P01" => ErrorKind::MissingTable,
            _ => ErrorKind::Database,
        };
        Self::new(kind, format!("{context}: {}", outbox_pg::db_error_text(&e)))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // One line, whatever a server's message holds.
        let mut first = true;
        for line in self.message.lines() {
            if !first {
                f.write_str(" ")?;
            }
            f.write_str(line.trim())?;
            first = false;
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

impl From<outbox_pg::Error> for Error {
    fn from(e: outbox_pg::Error) -> Self {
        let kind = match e.kind() {
            outbox_pg::ErrorKind::Config => ErrorKind::Config,
            outbox_pg::ErrorKind::Database => ErrorKind::Connect,
            outbox_pg::ErrorKind::Broker => ErrorKind::Nats,
            _ => ErrorKind::Database,
        };
        Self::new(kind, e.to_string())
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Self::new(ErrorKind::Io, format!("writing the output: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_of_several_lines_prints_as_one() {
        let e = Error::new(ErrorKind::Database, "first\n  second\nthird");
        assert_eq!(e.to_string(), "first second third");
    }
}
