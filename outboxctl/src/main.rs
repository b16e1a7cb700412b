//! `outboxctl`: what an operator needs when events are late.
//!
//! ```text
//! DATABASE_URL=postgres://owner@… outboxctl migrate [--sql-dir DIR]   # as the schema's owner
//! DATABASE_URL=postgres://… outboxctl status          # backlog, stuck rows, blocked subjects, relays
//! outboxctl stuck                                     # rows past the cap or failing, with their errors
//! outboxctl retry <id>… | --entity S | --all-stuck    # claimable again now
//! outboxctl skip <id> --reason "…"                    # abandon a poison row; its subject moves on
//! outboxctl prune [--dry-run]                         # outbox retention
//! outboxctl schedule list | show <id> | cancel <id>…  # scheduled events
//! outboxctl inbox status | prune                      # per consumer
//! outboxctl inbox owners | set-owner <consumer> <role> [--stream S]   # who owns each name
//! outboxctl dead-letters list | show <id> | replay <id>… | purge --older-than 30d
//! outboxctl audit [--since 1h] [--stream OUTBOX] [--republish] [--inbox-window 14d]   # messages the stream lost after acking
//! ```
//!
//! Every command prints JSON with `--json`. A wrong URL, a missing table or
//! an unknown id is one line on stderr and exit status 1 (with `--json`, also
//! `{"error": {"kind": …, "message": …}}` on stdout); a wrong flag is exit
//! status 2. `schedule cancel` prints its answers and exits with status 1
//! when any id was not cancelled.

mod audit;
mod db;
mod dead_letters;
mod deleted;
mod error;
mod inbox;
mod migrate;
mod nats;
mod outbox;
mod output;
mod time;
mod wal;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::db::Database;
use crate::error::Result;

#[derive(Debug, Parser)]
#[command(
    name = "outboxctl",
    version,
    about = "Operate an outbox and its inboxes: migrations, status, stuck rows, retry, skip, retention, scheduled events, dead letters"
)]
struct Cli {
    #[command(flatten)]
    database: Database,

    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the outbox's migrations, and with `--sql-dir` the service's own,
    /// as the connecting role (the schema's owner), so no service starts as
    /// the owner.
    Migrate(migrate::Args),
    /// Backlog, oldest unpublished age, rows in backoff and past the cap,
    /// blocked subjects, per event type; published in the last hour; relays.
    Status(outbox::status::Args),
    /// Rows past the attempt cap or failing, with attempts and last error.
    Stuck(outbox::stuck::Args),
    /// Make rows claimable again now.
    Retry(outbox::retry::Args),
    /// Abandon a poison row so the rows of its subject behind it move on: kept
    /// and recorded (who, when, why), never deleted, never reported as
    /// published.
    Skip(outbox::skip::Args),
    /// Delete published rows older than the retention window.
    Prune(outbox::prune::Args),
    /// Scheduled events: list them, show one, cancel them.
    #[command(subcommand)]
    Schedule(outbox::schedule::Command),
    /// The consumers' inboxes.
    #[command(subcommand)]
    Inbox(inbox::Command),
    /// Messages consumers could not handle.
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(dead_letters::Command),
    /// Read published rows' messages back from the stream by sequence and
    /// report those it lost after acking them; `--republish` has the relay
    /// publish them again.
    Audit(Box<audit::Args>),
    /// The replication slots of a WAL relay (`outbox-relay --source wal`).
    #[command(subcommand)]
    Wal(wal::Command),
}

/// Runs the command: `Ok(true)` when it did all it was asked, `Ok(false)`
/// when it reported some of it refused (exit status 1, the report printed).
async fn run(cli: Cli) -> Result<bool> {
    let db = &cli.database;
    let json = cli.json;
    let done = match &cli.command {
        Command::Migrate(args) => migrate::run(db, args, json).await,
        Command::Status(args) => outbox::status::run(db, args, json).await,
        Command::Stuck(args) => outbox::stuck::run(db, args, json).await,
        Command::Retry(args) => outbox::retry::run(db, args, json).await,
        Command::Skip(args) => outbox::skip::run(db, args, json).await,
        Command::Prune(args) => outbox::prune::run(db, args, json).await,
        Command::Schedule(command) => return outbox::schedule::run(db, command, json).await,
        Command::Inbox(command) => inbox::run(db, command, json).await,
        Command::DeadLetters(command) => dead_letters::run(db, command, json).await,
        Command::Audit(args) => audit::run(db, args, json).await,
        Command::Wal(command) => wal::run(db, command, json).await,
    };
    done.map(|()| true)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = cli.json;
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outboxctl: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("outboxctl: {e}");
            if json {
                let error = serde_json::json!({
                    "error": { "kind": e.kind().as_str(), "message": e.to_string() }
                });
                println!("{error}");
            }
            ExitCode::FAILURE
        }
    }
}
