//! `outboxctl inbox status | prune`: the consumers' inboxes.

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};

/// `outboxctl inbox …`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum Command {
    /// Rows, oldest and newest handled event, per consumer.
    Status,
    /// Delete inbox rows older than the retention window.
    Prune,
}

pub(crate) async fn run(db: &Database, command: &Command, json: bool) -> Result<()> {
    let _ = (db, command, json);
    Err(Error::new(ErrorKind::Config, "`outboxctl inbox` is not built yet"))
}
