//! Messages for people: durations as they are written, an error with its
//! causes on one line, and a database error without the server's C-source
//! location.

use std::fmt;
use std::time::Duration;

use sqlx::postgres::{PgDatabaseError, PgErrorPosition};

/// A duration as an operator writes it, for error messages and log lines:
/// `14d`, `2h30m`, `1m5s`, `1.5s`, `250ms`, `0s` (what `--retention 14d`
/// takes), not `1209600s` (Rust's `Debug`). Above a minute, parts of a
/// second are left out.
///
/// ```
/// use std::time::Duration;
/// use outbox_pg::HumanDuration;
///
/// assert_eq!(HumanDuration(Duration::from_secs(14 * 86_400)).to_string(), "14d");
/// assert_eq!(HumanDuration(Duration::from_millis(1_500)).to_string(), "1.5s");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HumanDuration(pub Duration);

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.is_zero() {
            return f.write_str("0s");
        }
        if d < Duration::from_millis(1) {
            return write!(f, "{}µs", d.as_micros());
        }
        if d < Duration::from_secs(1) {
            return write!(f, "{}ms", d.as_millis());
        }
        if d < Duration::from_secs(60) {
            let millis = d.subsec_millis();
            if millis == 0 {
                return write!(f, "{}s", d.as_secs());
            }
            let fraction = format!("{millis:03}");
            return write!(f, "{}.{}s", d.as_secs(), fraction.trim_end_matches('0'));
        }
        let mut rest = d.as_secs();
        for (unit, secs) in [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)] {
            let n = rest / secs;
            rest %= secs;
            if n > 0 {
                write!(f, "{n}{unit}")?;
            }
        }
        Ok(())
    }
}

/// `error` and its causes ([`source`](std::error::Error::source) after
/// source) on one line, joined by `: `, for a binary's last words; a cause
/// whose text the line already holds is left out (many errors repeat their
/// source in their own message). Rust's `main` returning `Err` prints the
/// `Debug` form instead: quoted, escaped, without the causes.
///
/// ```
/// let e = std::io::Error::other("the disk is full");
/// assert_eq!(outbox_pg::error_line(&e), "the disk is full");
/// ```
pub fn error_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error_text(error);
    let mut cause = error.source();
    while let Some(e) = cause {
        let text = error_text(e);
        if !text.is_empty() && !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = e.source();
    }
    line.replace(['\n', '\r'], " ")
}

/// One error's own text: a database error as [`db_error_text`] writes it,
/// any other as its `Display`.
pub(crate) fn error_text(error: &(dyn std::error::Error + 'static)) -> String {
    if let Some(e) = error.downcast_ref::<sqlx::Error>() {
        db_error_text(e)
    } else if let Some(e) = error.downcast_ref::<PgDatabaseError>() {
        pg_error_text(e)
    } else if let Some(e) = error
        .downcast_ref::<Box<dyn sqlx::error::DatabaseError>>()
        .and_then(|d| d.try_downcast_ref::<PgDatabaseError>())
    {
        // sqlx::Error::Database's source: the boxed server error.
        pg_error_text(e)
    } else {
        error.to_string()
    }
}

/// A failed statement's error as a person reads it: sqlx's text without the
/// location in PostgreSQL's C source that sqlx appends (`permission denied
/// for schema public at line 3655`, where 3655 is a line of the server's
/// `aclchk.c`, not of any SQL), and with where in the SQL it failed when
/// the server says so (`at character 15 of the statement`, or of the
/// function's query, and the PL/pgSQL context). Any other error is its
/// `Display`.
///
/// ```
/// let e = sqlx::Error::RowNotFound;
/// assert_eq!(outbox_pg::db_error_text(&e), e.to_string());
/// ```
pub fn db_error_text(error: &sqlx::Error) -> String {
    match error
        .as_database_error()
        .and_then(|d| d.try_downcast_ref::<PgDatabaseError>())
    {
        Some(pg) => format!("error returned from database: {}", pg_error_text(pg)),
        None => error.to_string(),
    }
}

/// A server's error or notice: its message, and where in the SQL it arose
/// (never the server's source file, line or routine).
fn pg_error_text(e: &PgDatabaseError) -> String {
    let mut text = e.message().to_owned();
    match e.position() {
        Some(PgErrorPosition::Original(at)) => {
            text.push_str(&format!(" (at character {at} of the statement)"));
        }
        Some(PgErrorPosition::Internal { position, query }) => {
            text.push_str(&format!(" (at character {position} of `{query}`)"));
        }
        None => {}
    }
    if let Some(context) = e.r#where().filter(|w| !w.is_empty()) {
        text.push_str(&format!(" (context: {})", context.replace('\n', "; ")));
    }
    text
}

/// A binary's exit: `SUCCESS`, or `result`'s error as one line on stderr,
/// `program: ` first ([`error_line`]), and `FAILURE` (exit status 1). For a
/// `main` that runs the program's body:
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> { Ok(()) }
/// #[tokio::main]
/// async fn main() -> std::process::ExitCode {
///     outbox_pg::exit_code("billing", run().await)
/// }
/// ```
pub fn exit_code(
    program: &str,
    result: Result<(), Box<dyn std::error::Error>>,
) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{program}: {}", error_line(&*e));
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error, &'static str);
    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.1)
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn an_error_line_holds_each_cause_once_on_one_line() {
        let inner = || std::io::Error::other("connection refused");
        assert_eq!(
            error_line(&Outer(inner(), "connecting to NATS")),
            "connecting to NATS: connection refused"
        );
        assert_eq!(
            error_line(&Outer(inner(), "connecting to NATS: connection refused")),
            "connecting to NATS: connection refused"
        );
        assert_eq!(
            error_line(&Outer(inner(), "two\nlines")),
            "two lines: connection refused"
        );
    }

    #[test]
    fn durations_read_as_written() {
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_micros(250), "250µs"),
            (Duration::from_millis(250), "250ms"),
            (Duration::from_secs(1), "1s"),
            (Duration::from_millis(1_500), "1.5s"),
            (Duration::from_millis(2_050), "2.05s"),
            (Duration::from_secs(60), "1m"),
            (Duration::from_millis(65_500), "1m5s"),
            (Duration::from_secs(2 * 3_600 + 30 * 60), "2h30m"),
            (Duration::from_secs(14 * 86_400), "14d"),
            (Duration::from_secs(86_400 + 3_600 + 61), "1d1h1m1s"),
        ];
        for (d, want) in cases {
            assert_eq!(HumanDuration(d).to_string(), want, "{d:?}");
        }
    }
}
