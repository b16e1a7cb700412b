//! Scheduled events: written and cancelled inside the caller's transaction,
//! published by the relay once, at or after their due time.
//!
//! A scheduled event is a row of `outbox_events` with a due time
//! (`due_at`, an extension column). It commits or rolls back with the
//! caller's transaction like any event, and so does its cancellation: a
//! reservation confirmed in the transaction that cancels its expiry cannot
//! also expire.
//!
//! - **Not before its time, by the database's clock.** The relay's due lane
//!   takes a row only once `next_attempt_at <= now()` in PostgreSQL, and a
//!   trigger keeps `next_attempt_at` at or after `due_at` until the row is
//!   published, whoever updates it. A due time not after the transaction's
//!   start is no schedule: the row is an immediate event.
//! - **Cancelled means never published.** [`Outbox::cancel`] answers
//!   [`Cancellation::Cancelled`] only for a row no relay has taken yet; a
//!   relay takes a fallen-due row in one short statement that skips rows
//!   locked by a cancel in progress, and a cancel that meets a relay's
//!   statement waits for it and answers
//!   [`Cancellation::AlreadyPublished`]. Never both, never neither.
//! - **Order.** A scheduled event is not part of its entity's immediate
//!   order: it neither holds back nor waits behind the entity's immediate
//!   events. Its message carries no `sequence` (so a consumer's stale-event
//!   guard cannot take it for an old state) and a `scheduledfor` attribute,
//!   its due time. Scheduled events of one entity due at the same time are
//!   published in insert order.
//!
//! Plain SQL schedules by setting the column:
//! `insert into outbox_events (…, due_at) values (…, now() + interval '14 days')`.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use outbox_pg::{Cancellation, Due, Envelope, Outbox};
//!
//! # #[allow(dead_code)]
//! # async fn example(pool: sqlx::PgPool) -> outbox_pg::Result<()> {
//! let outbox = Outbox::unvalidated();
//! let reminder = Envelope::new(
//!     "invoice.reminder_due",
//!     "billing",
//!     "invoice-7",
//!     serde_json::json!({"invoice_id": "invoice-7"}),
//! )?;
//! let mut tx = pool.begin().await.map_err(|e| outbox_pg::Error::database("begin", e))?;
//! let id = outbox
//!     .schedule(&mut tx, &reminder, Due::In(Duration::from_secs(3 * 24 * 3600)))
//!     .await?;
//! tx.commit().await.map_err(|e| outbox_pg::Error::database("commit", e))?;
//!
//! // Later, when the invoice is paid, in the transaction that records it:
//! let mut tx = pool.begin().await.map_err(|e| outbox_pg::Error::database("begin", e))?;
//! match outbox.cancel(&mut tx, id).await? {
//!     Cancellation::Cancelled => {}        // it will never be published
//!     Cancellation::AlreadyPublished => {} // too late: consumers get it
//!     Cancellation::Unknown => {}          // no such event in this outbox
//!     _ => {}
//! }
//! tx.commit().await.map_err(|e| outbox_pg::Error::database("commit", e))?;
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use serde::Serialize;
use sqlx::PgTransaction;

use crate::envelope::{Envelope, EventId};
use crate::error::{Error, Result};
use crate::outbox::{Outbox, Rows};

/// When a scheduled event falls due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Due {
    /// At this time (by the database's clock).
    At(chrono::DateTime<chrono::Utc>),
    /// This long after the transaction's start (PostgreSQL's `now()`), so
    /// the writer's clock plays no part.
    In(Duration),
}

/// What a cancel found ([`Outbox::cancel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cancellation {
    /// The event will never be published: cancelled by this call, or by an
    /// earlier one. (Rolled back with the caller's transaction, it is not.)
    Cancelled,
    /// Too late: the event was published, or a relay has taken it, fallen
    /// due, for publishing (it will be published, at least once), or it was
    /// never scheduled (an immediate event, on its way).
    AlreadyPublished,
    /// No event with this id in the outbox the transaction's `search_path`
    /// leads to (never written, rolled back, or deleted by retention).
    Unknown,
}

impl Outbox {
    /// Writes `event` to be published at or after `due`, in `tx`: it is
    /// scheduled when `tx` commits, and never fires if `tx` rolls back.
    /// Validated as [`Outbox::enqueue`] validates (schema, size, envelope).
    /// A due time not after the transaction's start makes an immediate event.
    ///
    /// # Errors
    /// As [`Outbox::enqueue`].
    pub async fn schedule<T: Serialize>(
        &self,
        tx: &mut PgTransaction<'_>,
        event: &Envelope<T>,
        due: Due,
    ) -> Result<EventId> {
        let ids = self
            .schedule_all(tx, std::slice::from_ref(event), due)
            .await?;
        Ok(ids[0])
    }

    /// Schedules many events, all due at `due`, in one statement; if any
    /// fails validation, none is written.
    ///
    /// # Errors
    /// As [`Outbox::enqueue`]; a validation error names the failing event type.
    pub async fn schedule_all<T: Serialize>(
        &self,
        tx: &mut PgTransaction<'_>,
        events: &[Envelope<T>],
        due: Due,
    ) -> Result<Vec<EventId>> {
        let rows = Rows::build(self, events, true)?;
        if rows.ids.is_empty() {
            return Ok(Vec::new());
        }
        let (at, after_ms) = match due {
            Due::At(at) => (Some(at), 0),
            Due::In(delay) => (None, i64::try_from(delay.as_millis()).unwrap_or(i64::MAX)),
        };
        sqlx::query_file!(
            "queries/schedule_events.sql",
            &rows.ids,
            &rows.event_types,
            &rows.sources,
            &rows.subjects,
            &rows.times,
            &rows.data,
            &rows.traceparents as &[Option<String>],
            &rows.tracestates as &[Option<String>],
            at,
            after_ms,
        )
        .persistent(self.persistent)
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::database("scheduling events in outbox_events", e))?;
        Ok(events.iter().map(Envelope::id).collect())
    }

    /// Cancels the scheduled event `id` in `tx`, recording the session's
    /// database role as who cancelled it; see [`Outbox::cancel_as`].
    ///
    /// # Errors
    /// As [`Outbox::cancel_as`].
    pub async fn cancel(&self, tx: &mut PgTransaction<'_>, id: EventId) -> Result<Cancellation> {
        self.cancel_as(tx, id, None).await
    }

    /// Cancels the scheduled event `id` in `tx`, recording `by` (or the
    /// session's role) and the time in `cancelled_by` and `cancelled_at`.
    /// The answer holds once `tx` commits: [`Cancellation::Cancelled`] then
    /// means the event is never published; rolled back, the cancel never
    /// happened. Run it at READ COMMITTED (PostgreSQL's default): at
    /// REPEATABLE READ or above, a cancel that meets a relay taking the
    /// event fails with a serialization error, to be retried.
    ///
    /// # Errors
    /// [`ErrorKind::Database`](crate::ErrorKind::Database) if a statement
    /// fails (the transaction is then aborted).
    pub async fn cancel_as(
        &self,
        tx: &mut PgTransaction<'_>,
        id: EventId,
        by: Option<&str>,
    ) -> Result<Cancellation> {
        let uuid = *id.as_uuid();
        let cancelled = sqlx::query_file!("queries/cancel_event.sql", uuid, by)
            .persistent(self.persistent)
            .execute(&mut **tx)
            .await
            .map_err(|e| Error::database(&format!("cancelling event {id}"), e))?;
        if cancelled.rows_affected() > 0 {
            return Ok(Cancellation::Cancelled);
        }
        let found: i32 = sqlx::query_scalar(include_str!("../queries/cancel_lookup.sql"))
            .bind(uuid)
            .persistent(self.persistent)
            .fetch_one(&mut **tx)
            .await
            .map_err(|e| Error::database(&format!("looking up event {id}"), e))?;
        Ok(match found {
            0 => Cancellation::Unknown,
            1 => Cancellation::AlreadyPublished,
            _ => Cancellation::Cancelled,
        })
    }
}
