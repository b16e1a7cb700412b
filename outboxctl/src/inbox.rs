//! `outboxctl inbox status | prune | owners | set-owner`: the consumers'
//! inboxes, per consumer, and who owns each consumer's name.
//!
//! A consumer is a JetStream durable name, and the `consumer` column of
//! `inbox_events`, `inbox_dead_letters` and `inbox_leases`. The consumers are
//! found by a skip-scan of the tables' indexes (one probe per consumer), so
//! neither command reads a big inbox row by row to list them.

mod owners;
mod prune;
mod status;

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};

/// `outboxctl inbox …`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum Command {
    /// Per consumer: inbox rows, oldest and newest handled_at, dead letters
    /// (count, not yet replayed, newest), and the lease row of an ordered
    /// consumer (holder, epoch, acquired_at, released).
    Status(status::Args),
    /// Delete inbox rows handled longer ago than the retention window, per
    /// consumer, in batches that never wait on a handler's transaction.
    ///
    /// An inbox row is what makes a redelivered event a duplicate: pruning it
    /// while the event can still arrive again (a JetStream redelivery, the
    /// relay publishing again after a lost mark, a replay of the stream)
    /// turns that late delivery into a second effect. Keep the window longer
    /// than every way an event can come back (default 14 days, as the
    /// consumer runtime's own pruning).
    Prune(prune::Args),
    /// Per registered consumer: the role owning its name (whose members alone
    /// may read and write its inbox rows, dead letters and lease), its
    /// stream and filter subjects.
    Owners(owners::ListArgs),
    /// Hand a consumer's name to another role, or, with --stream, claim a
    /// name before its consumer first starts (the first registration claims
    /// a name for the role it runs under). A runtime still running under the
    /// previous owner has its writes refused until it runs under the new one.
    #[command(name = "set-owner")]
    SetOwner(owners::SetArgs),
}

pub(crate) async fn run(db: &Database, command: &Command, json: bool) -> Result<()> {
    match command {
        Command::Status(args) => status::run(db, args, json).await,
        Command::Prune(args) => prune::run(db, args, json).await,
        Command::Owners(args) => owners::list(db, args, json).await,
        Command::SetOwner(args) => owners::set(db, args, json).await,
    }
}

/// The consumers the inbox tables know, from their indexes.
///
/// # Errors
/// [`ErrorKind::Database`] (or [`ErrorKind::MissingTable`]) if the lookup
/// fails.
pub(crate) async fn consumers(pool: &sqlx::PgPool) -> Result<Vec<String>> {
    sqlx::query_file_scalar!("queries/inbox_consumers.sql")
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("listing the consumers", e))
}

/// `[consumer]` if the tables know it, else every consumer; or
/// [`ErrorKind::NotFound`] naming an unknown one (and the known ones).
pub(crate) async fn select_consumers(
    pool: &sqlx::PgPool,
    consumer: Option<&str>,
) -> Result<Vec<String>> {
    let known = consumers(pool).await?;
    let Some(consumer) = consumer else {
        return Ok(known);
    };
    if known.iter().any(|k| k == consumer) {
        return Ok(vec![consumer.to_owned()]);
    }
    Err(Error::new(
        ErrorKind::NotFound,
        format!(
            "consumer `{consumer}` not found: no row of inbox_events, inbox_dead_letters or \
             inbox_leases names it (known: {})",
            if known.is_empty() {
                "none".to_owned()
            } else {
                known.join(", ")
            }
        ),
    ))
}
