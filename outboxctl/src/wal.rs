//! `outboxctl wal status | drop-slot`: the replication slots of a WAL relay
//! (`outbox-relay --source wal`).
//!
//! A slot keeps on the server every byte of WAL it has not confirmed, so a
//! slot nobody reads any more (a relay retired, or moved to polling) makes
//! `pg_wal` grow until the disk is full or `max_slot_wal_keep_size`
//! invalidates it. `status` shows each logical slot of the database with its
//! reader and lag; `drop-slot` drops one nobody reads. Dropping the slot of a
//! relay that still runs loses nothing: it publishes the unmarked rows
//! through the polling path and makes the slot again.
//!
//! `--json`:
//!
//! ```text
//! status:    {"slots": [{"slot": "outbox_relay_app_public", "plugin": "pgoutput",
//!                        "active": true, "active_pid": 4242, "wal_status": "reserved",
//!                        "confirmed_flush_lsn": "0/1A2B3C4", "lag_bytes": 1024}]}
//! drop-slot: {"slot": "outbox_relay_app_public", "dropped": true}
//! ```

use std::io::Write;

use serde::Serialize;

use crate::db::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::output::{self, Report};

/// `outboxctl wal …`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum Command {
    /// The logical replication slots of the database: reader, WAL status and
    /// how far each is behind the server's WAL.
    Status,
    /// Drop a replication slot nobody reads (refused while a relay reads it).
    #[command(name = "drop-slot")]
    DropSlot {
        /// The slot's name (see `outboxctl wal status`).
        slot: String,
    },
}

#[derive(Debug, Serialize)]
struct Slots {
    slots: Vec<Slot>,
}

#[derive(Debug, Serialize)]
struct Slot {
    slot: String,
    plugin: Option<String>,
    active: bool,
    active_pid: Option<i32>,
    wal_status: Option<String>,
    confirmed_flush_lsn: Option<String>,
    lag_bytes: Option<i64>,
}

#[derive(Debug, Serialize)]
struct Dropped {
    slot: String,
    dropped: bool,
}

impl Report for Slots {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        if self.slots.is_empty() {
            return writeln!(out, "no logical replication slot in this database");
        }
        let mut rows = vec![
            [
                "slot",
                "plugin",
                "reader",
                "wal_status",
                "confirmed",
                "behind",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for s in &self.slots {
            rows.push(vec![
                s.slot.clone(),
                s.plugin.clone().unwrap_or_default(),
                s.active_pid
                    .map_or_else(|| "none".to_owned(), |p| format!("pid {p}")),
                s.wal_status.clone().unwrap_or_default(),
                s.confirmed_flush_lsn.clone().unwrap_or_default(),
                s.lag_bytes.map_or_else(String::new, |b| format!("{b} B")),
            ]);
        }
        output::table(out, &rows)
    }
}

impl Report for Dropped {
    fn human(&self, out: &mut dyn Write) -> std::io::Result<()> {
        writeln!(out, "dropped replication slot {}", self.slot)
    }
}

pub(crate) async fn run(db: &Database, command: &Command, json: bool) -> Result<()> {
    let pool = db.connect(&[]).await?;
    match command {
        Command::Status => {
            let slots = sqlx::query_file_as!(Slot, "queries/wal_slots.sql")
                .fetch_all(&pool)
                .await
                .map_err(|e| Error::database("reading the replication slots", e))?;
            output::print(&Slots { slots }, json)
        }
        Command::DropSlot { slot } => {
            let dropped = sqlx::query_file_scalar!("queries/wal_drop_slot.sql", slot)
                .fetch_optional(&pool)
                .await
                .map_err(|e| Error::database("dropping the replication slot", e))?;
            match dropped.flatten() {
                Some(true) => output::print(
                    &Dropped {
                        slot: slot.clone(),
                        dropped: true,
                    },
                    json,
                ),
                Some(false) => Err(Error::new(
                    ErrorKind::InvalidState,
                    format!(
                        "replication slot {slot} is being read (a WAL relay leads it): stop that relay \
                         first, or run it with --source poll"
                    ),
                )),
                None => Err(Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "no replication slot {slot} in this database (`outboxctl wal status` lists them)"
                    ),
                )),
            }
        }
    }
}
