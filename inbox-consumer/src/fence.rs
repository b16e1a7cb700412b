//! The leadership fence: an ordered consumer's leader checks, inside each
//! handler transaction and just before its commit, that it still leads. The
//! runtime holds the lease ([`runtime`](crate::runtime#ordered-consumption));
//! the dedupe layer, which owns the transaction, takes the fence.
//!
//! The check is two statements, `queries/lease_fence_shared.sql` (the fence
//! lock, shared) and then `queries/lease_epoch.sql` (the epoch): the second
//! must take its snapshot once the lock is held, so they cannot be one
//! statement. They go to the server as one simple query, in one round trip:
//! PostgreSQL runs the statements of a simple query one after the other, each
//! with a snapshot of its own (read committed), exactly as if sent apart. A
//! simple query takes no parameters, so the consumer's name is written into
//! it as an escaped literal ([`literal`]).

use sqlx::{PgConnection, Row};

use crate::error::{Error, ErrorKind};

const FENCE_SHARED: &str = include_str!("../queries/lease_fence_shared.sql");
const EPOCH: &str = include_str!("../queries/lease_epoch.sql");

/// Checks, inside a leader's handler transaction and just before its commit,
/// that `epoch` is still the consumer's leader epoch.
///
/// # Errors
/// [`ErrorKind::LeaseLost`] if another replica has taken the lead since;
/// [`ErrorKind::Database`] if a statement fails.
pub(crate) async fn check_fence(
    conn: &mut PgConnection,
    consumer: &str,
    epoch: i64,
) -> Result<(), Error> {
    let statements = fence_statements(consumer)?;
    let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(statements))
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| Error::database("taking the leadership fence and reading the epoch", e))?;
    // The lock's row first, then the epoch's row if the consumer has one.
    let current: Option<i64> = rows
        .iter()
        .find_map(|row| row.try_get::<i64, _>("epoch").ok());
    if current == Some(epoch) {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::LeaseLost,
        format!(
            "consumer `{consumer}` has a new leader (epoch {}); this transaction of epoch {epoch} rolls back",
            current.map_or_else(|| "none".to_owned(), |e| e.to_string()),
        ),
    ))
}

/// The fence's two statements as one simple query, without their comment
/// lines, `consumer` written in as a literal where the files say `$1`.
fn fence_statements(consumer: &str) -> Result<String, Error> {
    let name = literal(consumer)?;
    let statement = |sql: &str| {
        sql.lines()
            .filter(|line| !line.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n")
            .trim()
            .trim_end_matches(';')
            .replace("$1", &name)
    };
    Ok(format!(
        "{};\n{}",
        statement(FENCE_SHARED),
        statement(EPOCH)
    ))
}

/// `value` as a PostgreSQL string literal, `E'…'` with backslashes and quotes
/// doubled: read the same whatever `standard_conforming_strings` says.
///
/// # Errors
/// [`ErrorKind::Config`] for a NUL character, which no text value holds.
fn literal(value: &str) -> Result<String, Error> {
    if value.contains('\0') {
        return Err(Error::new(
            ErrorKind::Config,
            "a consumer name holds a NUL character",
        ));
    }
    let mut out = String::with_capacity(value.len() + 3);
    out.push_str("E'");
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("''"),
            c => out.push(c),
        }
    }
    out.push('\'');
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_literal_doubles_quotes_and_backslashes() {
        assert_eq!(literal("billing").unwrap(), "E'billing'");
        assert_eq!(literal(r"o'k\n").unwrap(), r"E'o''k\\n'");
        assert!(literal("a\0b").is_err());
    }

    #[test]
    fn the_fence_is_the_lock_then_the_epoch_with_the_name_in_both() {
        let sql = fence_statements("it's").unwrap();
        assert!(!sql.contains("$1"), "{sql}");
        let lock = sql.find("pg_advisory_xact_lock_shared").unwrap();
        let epoch = sql.find("select epoch from inbox_leases").unwrap();
        assert!(lock < epoch, "{sql}");
        assert_eq!(sql.matches("E'it''s'").count(), 2, "{sql}");
        assert_eq!(
            sql.matches(';').count(),
            1,
            "one statement separator: {sql}"
        );
    }
}
