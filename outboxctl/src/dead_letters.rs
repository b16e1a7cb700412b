//! `outboxctl dead-letters list | show | replay | purge`: the messages
//! consumers could not handle (`inbox_dead_letters`), and putting them back.
//!
//! A replay publishes the stored payload again to the stored NATS subject,
//! with the stored headers and [`REPLAY_CONSUMER_HEADER`] naming the consumer
//! that dead-lettered it: every other consumer of the stream acks it without
//! handling it, and that consumer handles it through its inbox. The event
//! keeps its own id (the CloudEvent `id` in the payload), so a consumer that
//! already applied it (a replay done twice) finds it a duplicate.
//!
//! [`REPLAY_CONSUMER_HEADER`]: inbox_consumer::dead_letter::REPLAY_CONSUMER_HEADER

mod list;
mod purge;
mod replay;
mod show;

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};

/// `outboxctl dead-letters …`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum Command {
    /// Dead letters, newest first, with the total the filters match.
    List(list::Args),
    /// One dead letter, every column: the payload as JSON, as text, or in
    /// base64, and its headers.
    Show(show::Args),
    /// Put dead letters back in front of the consumer that dead-lettered
    /// them: the stored payload and headers published again to the stored
    /// subject, for that consumer only, with the event's own id (so its inbox
    /// still dedupes it). Every id is checked before anything is published.
    Replay(Box<replay::Args>),
    /// Delete dead letters recorded longer ago than a duration.
    Purge(purge::Args),
}

pub(crate) async fn run(db: &Database, command: &Command, json: bool) -> Result<()> {
    match command {
        Command::List(args) => list::run(db, args, json).await,
        Command::Show(args) => show::run(db, args, json).await,
        Command::Replay(args) => replay::run(db, args, json).await,
        Command::Purge(args) => purge::run(db, args, json).await,
    }
}

/// A dead letter, whole.
#[derive(Debug)]
struct Row {
    id: i64,
    consumer: String,
    stream: String,
    stream_sequence: i64,
    subject: String,
    event_id: Option<uuid::Uuid>,
    delivery_count: i64,
    reason: String,
    error: String,
    headers: serde_json::Value,
    payload: Vec<u8>,
    /// The header block as stored, when no client could read it.
    raw_headers: Option<Vec<u8>>,
    created_at: DateTime<Utc>,
    replay_count: i32,
    replayed_at: Option<DateTime<Utc>>,
}

/// The dead letters of `ids`, in the order given (each once).
///
/// # Errors
/// [`ErrorKind::NotFound`] naming every id no row has, before anything else
/// is done; [`ErrorKind::Database`] if the read fails.
async fn fetch(pool: &PgPool, ids: &[i64]) -> Result<Vec<Row>> {
    let mut wanted = Vec::with_capacity(ids.len());
    let mut seen = BTreeSet::new();
    for id in ids {
        if seen.insert(*id) {
            wanted.push(*id);
        }
    }
    let rows = sqlx::query_file_as!(Row, "queries/dead_letters_get.sql", &wanted)
        .fetch_all(pool)
        .await
        .map_err(|e| Error::database("reading inbox_dead_letters", e))?;
    let missing: Vec<String> = wanted
        .iter()
        .filter(|id| !rows.iter().any(|r| r.id == **id))
        .map(ToString::to_string)
        .collect();
    if !missing.is_empty() {
        return Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "no dead letter with id {} in inbox_dead_letters",
                missing.join(", ")
            ),
        ));
    }
    let mut rows: Vec<Option<Row>> = rows.into_iter().map(Some).collect();
    Ok(wanted
        .iter()
        .filter_map(|id| {
            rows.iter_mut()
                .find(|r| r.as_ref().is_some_and(|r| r.id == *id))
                .and_then(Option::take)
        })
        .collect())
}
