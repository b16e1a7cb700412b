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
//! it as an escaped literal ([`literal`]), and the lock's keys as numbers.
//!
//! A simple query is planned at every run, so it holds nothing costly to
//! plan: the lock's keys ([`FenceKey`], `queries/lease_fence_key.sql`: the
//! consumer's name and the schema its inbox is in, which takes a catalog
//! join) are read once by a new leader, which takes the exclusive side on the
//! same keys, and carried by its deliveries. Read at every commit, the keys
//! cost PostgreSQL about 200 µs of planning per transaction.

use sqlx::{PgConnection, Row};

use crate::error::{Error, ErrorKind};

const FENCE_SHARED: &str = include_str!("../queries/lease_fence_shared.sql");

/// The two keys of a consumer's leadership fence (its schema and its name, as
/// `queries/lease_fence_key.sql` hashes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FenceKey {
    schema: i32,
    name: i32,
}

impl FenceKey {
    /// The fence keys of `consumer`, for the inbox `conn`'s `search_path`
    /// leads to.
    ///
    /// # Errors
    /// [`ErrorKind::Database`] if the statement fails.
    pub(crate) async fn read(conn: &mut PgConnection, consumer: &str) -> Result<Self, Error> {
        let key = sqlx::query_file!("queries/lease_fence_key.sql", consumer)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| Error::database("reading the leadership fence's keys", e))?;
        Ok(Self {
            schema: key.schema,
            name: key.name,
        })
    }

    /// The exclusive side, taken by a new leader around its epoch bump.
    ///
    /// # Errors
    /// [`ErrorKind::Database`] if the statement fails.
    pub(crate) async fn lock_exclusive(self, conn: &mut PgConnection) -> Result<(), Error> {
        sqlx::query_file!("queries/lease_fence_exclusive.sql", self.schema, self.name)
            .execute(&mut *conn)
            .await
            .map_err(|e| Error::database("taking the leadership fence", e))?;
        Ok(())
    }
}
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
    key: Option<FenceKey>,
) -> Result<(), Error> {
    // A delivery marked by hand (`Delivery::with_leader_epoch`) carries no
    // keys: read them first.
    let key = match key {
        Some(key) => key,
        None => FenceKey::read(conn, consumer).await?,
    };
    let statements = fence_statements(consumer, key)?;
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
fn fence_statements(consumer: &str, key: FenceKey) -> Result<String, Error> {
    let name = literal(consumer)?;
    let statement = |sql: &str| {
        sql.lines()
            .filter(|line| !line.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n")
            .trim()
            .trim_end_matches(';')
            .to_owned()
    };
    let lock = statement(FENCE_SHARED)
        .replace("$1", &key.schema.to_string())
        .replace("$2", &key.name.to_string());
    let epoch = statement(EPOCH).replace("$1", &name);
    Ok(format!("{lock};\n{epoch}"))
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
    fn the_fence_is_the_lock_on_its_keys_then_the_epoch_of_the_name() {
        let key = FenceKey {
            schema: -12,
            name: 345,
        };
        let sql = fence_statements("it's", key).unwrap();
        assert!(!sql.contains('$'), "{sql}");
        let lock = sql.find("pg_advisory_xact_lock_shared(-12, 345)").unwrap();
        let epoch = sql.find("select epoch from inbox_leases").unwrap();
        assert!(lock < epoch, "{sql}");
        assert_eq!(sql.matches("E'it''s'").count(), 1, "{sql}");
        assert_eq!(
            sql.matches(';').count(),
            1,
            "one statement separator: {sql}"
        );
    }
}
