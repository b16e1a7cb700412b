//! The harness's error: a message that says what failed and how to fix it.

use std::fmt;

/// `Result` with the harness's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A failure to start, stop or reach a server.
#[derive(Debug)]
pub struct Error(String);

impl Error {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Self(format!("database: {e}"))
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Self(format!("io: {e}"))
    }
}

impl From<outbox_pg::Error> for Error {
    fn from(e: outbox_pg::Error) -> Self {
        Self(e.to_string())
    }
}
