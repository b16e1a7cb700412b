//! Writing events into `outbox_events` inside the caller's transaction.

use serde::Serialize;
use sqlx::PgTransaction;
use uuid::Uuid;

use crate::envelope::{Envelope, EventId};
use crate::error::{Error, ErrorKind, Result};
use crate::schema::SchemaRegistry;

const INSERT_EVENTS: &str = include_str!("../queries/insert_events.sql");

/// The write side of the outbox: validates payloads against their schemas and
/// appends envelopes to `outbox_events`.
///
/// Every write takes a `&mut PgTransaction`: an event can only be written as part
/// of a transaction the caller owns, and it commits or rolls back with the
/// caller's own writes. There is deliberately no variant taking a pool.
#[derive(Debug, Clone)]
pub struct Outbox {
    schemas: Option<SchemaRegistry>,
}

impl Outbox {
    /// An outbox that validates every payload with `schemas`; an event type with
    /// no schema is refused.
    pub fn new(schemas: SchemaRegistry) -> Self {
        Self {
            schemas: Some(schemas),
        }
    }

    /// An outbox that writes payloads without schema validation. Envelope
    /// attributes are still validated. Meant for tests and for events whose
    /// payloads were validated elsewhere.
    pub fn unvalidated() -> Self {
        Self { schemas: None }
    }

    /// The registry payloads are checked against, if any.
    pub fn schemas(&self) -> Option<&SchemaRegistry> {
        self.schemas.as_ref()
    }

    /// Appends one event. It becomes visible to the relay when `tx` commits and
    /// disappears if `tx` rolls back.
    ///
    /// # Errors
    /// [`ErrorKind::Serialization`] if the payload is not JSON-serializable;
    /// [`ErrorKind::UnknownEventType`] / [`ErrorKind::SchemaViolation`] if it fails
    /// validation (nothing is written); [`ErrorKind::Database`] if the insert
    /// fails (the transaction is then aborted, as with any failed statement).
    pub async fn enqueue<T: Serialize>(
        &self,
        tx: &mut PgTransaction<'_>,
        event: &Envelope<T>,
    ) -> Result<EventId> {
        let ids = self.enqueue_all(tx, std::slice::from_ref(event)).await?;
        Ok(ids[0])
    }

    /// Appends many events in one statement (one round trip, whatever the count).
    /// All are validated first; if any fails, none is written.
    ///
    /// # Errors
    /// As [`Outbox::enqueue`]; a validation error names the failing event type.
    pub async fn enqueue_all<T: Serialize>(
        &self,
        tx: &mut PgTransaction<'_>,
        events: &[Envelope<T>],
    ) -> Result<Vec<EventId>> {
        let rows = Rows::build(self.schemas.as_ref(), events)?;
        if rows.ids.is_empty() {
            return Ok(Vec::new());
        }
        sqlx::query(INSERT_EVENTS)
            .bind(&rows.ids)
            .bind(&rows.event_types)
            .bind(&rows.sources)
            .bind(&rows.subjects)
            .bind(&rows.times)
            .bind(&rows.data)
            .bind(&rows.traceparents)
            .bind(&rows.tracestates)
            .execute(&mut **tx)
            .await
            .map_err(|e| Error::database("inserting into outbox_events", e))?;
        Ok(events.iter().map(Envelope::id).collect())
    }
}

/// Column arrays for the `unnest` insert.
#[derive(Default)]
struct Rows {
    ids: Vec<Uuid>,
    event_types: Vec<String>,
    sources: Vec<String>,
    subjects: Vec<String>,
    times: Vec<chrono::DateTime<chrono::Utc>>,
    data: Vec<serde_json::Value>,
    traceparents: Vec<Option<String>>,
    tracestates: Vec<Option<String>>,
}

impl Rows {
    fn build<T: Serialize>(
        schemas: Option<&SchemaRegistry>,
        events: &[Envelope<T>],
    ) -> Result<Self> {
        let mut rows = Rows::default();
        for event in events {
            let event_type = event.event_type().as_str();
            let data = serde_json::to_value(event.data()).map_err(|e| {
                Error::new(
                    ErrorKind::Serialization,
                    format!("payload of event type `{event_type}` is not JSON-serializable: {e}"),
                )
                .with_event_type(event_type)
                .with_source(e)
            })?;
            if let Some(schemas) = schemas {
                schemas.validate(event_type, &data)?;
            }
            rows.ids.push(*event.id().as_uuid());
            rows.event_types.push(event_type.to_owned());
            rows.sources.push(event.source().to_owned());
            rows.subjects.push(event.subject().to_owned());
            rows.times.push(event.time());
            rows.data.push(data);
            rows.traceparents
                .push(event.traceparent().map(str::to_owned));
            rows.tracestates.push(event.tracestate().map(str::to_owned));
        }
        Ok(rows)
    }
}
