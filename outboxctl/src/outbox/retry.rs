//! `outboxctl retry`.

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};

/// Flags of `outboxctl retry`.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {}

pub(crate) async fn run(db: &Database, args: &Args, json: bool) -> Result<()> {
    let _ = (db, args, json);
    Err(Error::new(ErrorKind::Config, "`outboxctl retry` is not built yet"))
}
