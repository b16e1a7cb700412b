//! Which PostgreSQL failures are transient: one table, behind the
//! `is_transient` of the writers', the relay's and the consumer's error
//! types, and the consumer's ack decision (whether a failure is the
//! database's or the event's).
//!
//! A failure is classified where it is met, from the first `sqlx::Error` in
//! its `source` chain:
//!
//! | class | what | examples |
//! |---|---|---|
//! | [`PgFailure::Unavailable`] | the database could not be used at all; never the event's fault | lost or refused connection, TLS, pool timed out or closed, a protocol error (a connection is discarded after one), SQLSTATE class `08`, `57P01`–`57P03` (shutting down, starting), `53300` (too many connections), `55P03` (lock wait timed out), `25P03` (idle-in-transaction timeout) |
//! | [`PgFailure::Conflict`] | this transaction lost a race; running it again may succeed | `40001` (serialization failure), `40P01` (deadlock) |
//! | [`PgFailure::Denied`] | the role lacks a grant: an operator's fix, not the event's fault | `42501` |
//! | [`PgFailure::Other`] | anything else: the statement itself failed | a constraint, a missing table, a bad value |
//!
//! [`is_transient`] is `Unavailable` or `Conflict`.
//!
//! ```
//! use outbox_pg::failure::{PgFailure, classify, is_transient};
//!
//! let lost = sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
//! assert_eq!(classify(&lost), Some(PgFailure::Unavailable));
//! assert!(is_transient(&lost));
//! assert!(!is_transient(&sqlx::Error::RowNotFound));
//! ```

use std::error::Error as StdError;

/// SQLSTATE `42501`, `insufficient_privilege`: "permission denied for table …",
/// "must be owner of table …".
pub const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// Whether `error`, or an error in its `source` chain, is a database error
/// with SQLSTATE `42501` ([`INSUFFICIENT_PRIVILEGE`]).
pub fn is_insufficient_privilege(error: &(dyn StdError + 'static)) -> bool {
    sqlstate(error).as_deref() == Some(INSUFFICIENT_PRIVILEGE)
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

/// What a PostgreSQL failure says about retrying (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PgFailure {
    /// The database could not be used at all.
    Unavailable,
    /// A serialization failure or deadlock: the same transaction may succeed.
    Conflict,
    /// The role lacks a privilege (`42501`).
    Denied,
    /// The statement failed for a reason of its own.
    Other,
}

impl PgFailure {
    /// The class of one sqlx error.
    #[must_use]
    pub fn of(error: &sqlx::Error) -> Self {
        match error {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => Self::Unavailable,
            sqlx::Error::Database(db) => db
                .code()
                .map_or(Self::Other, |code| Self::of_sqlstate(&code)),
            _ => Self::Other,
        }
    }

    /// The class of a SQLSTATE.
    #[must_use]
    pub fn of_sqlstate(code: &str) -> Self {
        match code {
            "40001" | "40P01" => Self::Conflict,
            INSUFFICIENT_PRIVILEGE => Self::Denied,
            "57P01" | "57P02" | "57P03" | "53300" | "55P03" | "25P03" => Self::Unavailable,
            _ if code.starts_with("08") => Self::Unavailable,
            _ => Self::Other,
        }
    }

    /// Unavailable or a conflict: retrying may succeed, and the event is not
    /// at fault.
    #[must_use]
    pub fn is_transient(self) -> bool {
        matches!(self, Self::Unavailable | Self::Conflict)
    }
}

/// The class of the first `sqlx::Error` in `error`'s source chain (`error`
/// itself included); `None` when there is none.
#[must_use]
pub fn classify(error: &(dyn StdError + 'static)) -> Option<PgFailure> {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if let Some(sqlx) = e.downcast_ref::<sqlx::Error>() {
            return Some(PgFailure::of(sqlx));
        }
        cause = e.source();
    }
    None
}

/// Whether `error` holds a PostgreSQL failure that retrying may get past
/// ([`PgFailure::is_transient`]).
#[must_use]
pub fn is_transient(error: &(dyn StdError + 'static)) -> bool {
    classify(error).is_some_and(PgFailure::is_transient)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the four tables this one replaced disagreed, the choice and why:
    /// - class `08` and `57P01`–`57P03`: the writers' and the consumer's
    ///   errors called a server shutting down permanent; it is the server,
    ///   not the call, so transient everywhere.
    /// - `Protocol`: only the relay called it transient; sqlx discards the
    ///   connection after one (a pooler or a broken stream), so a retry on a
    ///   new connection may pass: transient.
    /// - `Tls`: only the ack decision had it; a handshake that failed once
    ///   (a restarting server, a proxy) may pass: transient. A TLS setting
    ///   that can never work is refused at start by the binaries' checks.
    /// - `42501`: the ack decision retries it (loudly, until granted) and
    ///   does not count it against the event: `Denied`, not transient for
    ///   callers asking whether the same call may pass on its own.
    #[test]
    fn sqlstates() {
        for (code, class) in [
            ("40001", PgFailure::Conflict),
            ("40P01", PgFailure::Conflict),
            ("08000", PgFailure::Unavailable),
            ("08006", PgFailure::Unavailable),
            ("08P01", PgFailure::Unavailable),
            ("57P01", PgFailure::Unavailable),
            ("57P02", PgFailure::Unavailable),
            ("57P03", PgFailure::Unavailable),
            ("53300", PgFailure::Unavailable),
            ("55P03", PgFailure::Unavailable),
            ("25P03", PgFailure::Unavailable),
            ("42501", PgFailure::Denied),
            ("42P01", PgFailure::Other),
            ("23505", PgFailure::Other),
            ("22P02", PgFailure::Other),
            ("57014", PgFailure::Other),
            ("53100", PgFailure::Other),
        ] {
            assert_eq!(PgFailure::of_sqlstate(code), class, "{code}");
        }
    }

    #[test]
    fn sqlx_variants() {
        let io = || sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        for (error, class) in [
            (io(), PgFailure::Unavailable),
            (sqlx::Error::Tls("handshake".into()), PgFailure::Unavailable),
            (
                sqlx::Error::Protocol("unexpected".into()),
                PgFailure::Unavailable,
            ),
            (sqlx::Error::PoolTimedOut, PgFailure::Unavailable),
            (sqlx::Error::PoolClosed, PgFailure::Unavailable),
            (sqlx::Error::WorkerCrashed, PgFailure::Unavailable),
            (sqlx::Error::RowNotFound, PgFailure::Other),
            (sqlx::Error::ColumnNotFound("x".into()), PgFailure::Other),
        ] {
            let shown = error.to_string();
            assert_eq!(PgFailure::of(&error), class, "{shown}");
            assert_eq!(classify(&error), Some(class), "{shown}");
        }
    }

    /// A chain is read down to its first sqlx error.
    #[test]
    fn chains() {
        #[derive(Debug)]
        struct Wrapped(sqlx::Error);
        impl std::fmt::Display for Wrapped {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl StdError for Wrapped {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        assert!(is_transient(&Wrapped(sqlx::Error::PoolTimedOut)));
        assert!(!is_transient(&Wrapped(sqlx::Error::RowNotFound)));
        assert_eq!(classify(&std::fmt::Error), None);
        assert!(!is_transient(&std::fmt::Error));
    }
}
