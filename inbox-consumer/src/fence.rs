//! The leadership fence: an ordered consumer's leader checks, inside each
//! handler transaction and just before its commit, that it still leads. The
//! runtime holds the lease ([`runtime`](crate::runtime#ordered-consumption));
//! the dedupe layer, which owns the transaction, takes the fence.

use sqlx::PgConnection;

use crate::error::{Error, ErrorKind};

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
    sqlx::query_file!("queries/lease_fence_shared.sql", consumer)
        .execute(&mut *conn)
        .await
        .map_err(|e| Error::database("taking the leadership fence", e))?;
    let current: Option<i64> = sqlx::query_file_scalar!("queries/lease_epoch.sql", consumer)
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| Error::database("reading the leader epoch", e))?;
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
