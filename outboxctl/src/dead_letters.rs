//! `outboxctl dead-letters list | show | replay | purge`.

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};

/// `outboxctl dead-letters …`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum Command {
    /// Dead letters, newest first.
    List,
    /// One dead letter, whole.
    Show,
    /// Put the original event back in front of its consumer, with its id.
    Replay,
    /// Delete dead letters older than a duration.
    Purge,
}

pub(crate) async fn run(db: &Database, command: &Command, json: bool) -> Result<()> {
    let _ = (db, command, json);
    Err(Error::new(ErrorKind::Config, "`outboxctl dead-letters` is not built yet"))
}
