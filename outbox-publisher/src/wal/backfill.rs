//! The backfill's record: whether the rows a slot cannot stream (those
//! committed before it was made) were published through the polling path,
//! and up to which seq (`outbox_relay_slots`, the SQL in
//! `queries/wal_backfill_*.sql`).
//!
//! # Catching up from the slot
//!
//! A relay that takes the lead of an intact slot whose backfill is recorded
//! reads on from the slot's confirmed position with that floor: the WAL
//! brings every row it lacks, at the WAL's speed, and no polling backfill
//! runs. Why nothing is lost:
//! - every row at or below the floor was published by the backfill before
//!   the record was written;
//! - every row above it commits after the slot's start, so it is in the
//!   slot's stream; those in transactions before the confirmed position
//!   were given their outcome (marked, recorded in the retry lane) before the
//!   slot moved past them, and the others are streamed again;
//! - the record is deleted before the relay makes the slot (again), so it
//!   never speaks of a slot made after it; a relay whose monitor finds rows
//!   left behind deletes it too, and the next leader backfills.
//!
//! Why nothing is published twice or out of order beyond what a restart
//! always allows: the rows streamed again from the confirmed position are
//! those of the leader before, some of them already published. While it
//! reads WAL written before it took the lead, the pipeline waits until the
//! rows' transactions are visible, passes over every row that is no longer
//! fresh (published, in the retry lane, or deleted since by retention:
//! `queries/wal_still_fresh.sql`) and publishes only the others, in commit
//! order, each subject checked against the retry lane first as in every
//! session. Because it waits for visibility first, a row is never passed
//! over because the database cannot show it yet. The look runs beside
//! publishing, one at a time, so rows are taken on in read order.
//! What is published again is what the leader before published and did not
//! mark: a row of its last moments, which the stream's duplicate window
//! stores once.
//!
//! A relay kill -9'd while it catches up leaves the slot where its last
//! recorded outcomes put it, and the record as it was: the next leader
//! catches up from there the same way.
//!
//! Without the record (an older relay made the slot, or its backfill was
//! cut short) the relay backfills as for a new slot. A role that may not
//! read or write the table (`ops/sql/roles.sql` grants it to `outbox_relay`)
//! is named once in a warning, and the relay backfills at every lead: slower,
//! never wrong.

use sqlx::PgPool;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing::warn;

use crate::error::{Error, Result};

/// The table a backfill is recorded in.
const TABLE: &str = "outbox_relay_slots";

/// The backfill's record of one slot, as one relay process may use it.
#[derive(Debug, Default)]
pub(super) struct Record {
    /// The table cannot be used by this relay (missing, or not granted):
    /// said once, then every lead backfills.
    unusable: AtomicBool,
}

impl Record {
    /// The floor of `slot`'s recorded backfill, if there is one.
    ///
    /// # Errors
    /// [`ErrorKind::Database`](crate::ErrorKind::Database) for a database
    /// fault (not for a table this relay may not read: then `None`).
    pub(super) async fn floor(&self, pool: &PgPool, slot: &str) -> Result<Option<i64>> {
        if self.unusable.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let read = sqlx::query_file_scalar!("queries/wal_backfill_floor.sql", slot)
            .fetch_optional(pool)
            .await;
        self.checked(read, "reading the WAL source's backfill record")
            .map(Option::flatten)
    }

    /// Records that `slot`'s backfill is done up to `floor`.
    ///
    /// # Errors
    /// [`ErrorKind::Database`](crate::ErrorKind::Database) for a database
    /// fault (not for a table this relay may not write).
    pub(super) async fn done(&self, pool: &PgPool, slot: &str, floor: i64) -> Result<()> {
        if self.unusable.load(Ordering::Relaxed) {
            return Ok(());
        }
        let written = sqlx::query_file!("queries/wal_backfill_record.sql", slot, floor)
            .execute(pool)
            .await;
        self.checked(written, "recording the WAL source's backfill")
            .map(drop)
    }

    /// Forgets `slot`'s backfill: before the slot is made (again), and when
    /// rows were left behind.
    ///
    /// # Errors
    /// [`ErrorKind::Database`](crate::ErrorKind::Database) for a database
    /// fault (not for a table this relay may not write).
    pub(super) async fn forget(&self, pool: &PgPool, slot: &str) -> Result<()> {
        if self.unusable.load(Ordering::Relaxed) {
            return Ok(());
        }
        let deleted = sqlx::query_file!("queries/wal_backfill_forget.sql", slot)
            .execute(pool)
            .await;
        self.checked(deleted, "forgetting the WAL source's backfill")
            .map(drop)
    }

    /// `result`'s value; `None` when the table is missing or not granted,
    /// which is said once.
    fn checked<T>(
        &self,
        result: std::result::Result<T, sqlx::Error>,
        context: &str,
    ) -> Result<Option<T>> {
        match result {
            Ok(value) => Ok(Some(value)),
            Err(e) => {
                let code = outbox_pg::sqlstate(&e);
                let missing = code.as_deref() == Some("42P01");
                if !missing && !outbox_pg::is_insufficient_privilege(&e) {
                    return Err(Error::database(context, e));
                }
                if !self.unusable.swap(true, Ordering::Relaxed) {
                    let fix = if missing {
                        "run the outbox migrations (outbox_pg::migrate)".to_owned()
                    } else {
                        format!(
                            "grant select, insert, update, delete on {TABLE} to outbox_relay \
                             (ops/sql/roles.sql)"
                        )
                    };
                    warn!(
                        error = %e,
                        "the relay cannot use {TABLE}, so it cannot tell that a slot's backfill was done: \
                         every lead publishes the rows not yet marked through the polling path before \
                         it reads the WAL, which is slower after a restart; {fix}"
                    );
                }
                Ok(None)
            }
        }
    }
}
