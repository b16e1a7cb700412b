//! Writing events into `outbox_events` inside the caller's transaction.

use serde::Serialize;
use sqlx::PgTransaction;
use uuid::Uuid;

use crate::envelope::{Envelope, EventId};
use crate::error::{Error, ErrorKind, Result};
use crate::jsonb::rendered_len;
use crate::schema::SchemaRegistry;
use crate::validate::check_json_decodable;

/// Default of [`Outbox::max_message_size`]: 1 MiB, the default `max_payload`
/// of nats-server.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 1_048_576;

/// The write side of the outbox: validates payloads against their schemas and
/// appends envelopes to `outbox_events`.
///
/// Every write takes a `&mut PgTransaction`: an event can only be written as part
/// of a transaction the caller owns, and it commits or rolls back with the
/// caller's own writes. There is deliberately no variant taking a pool.
#[derive(Debug, Clone)]
pub struct Outbox {
    schemas: Option<SchemaRegistry>,
    max_message_size: usize,
    pub(crate) persistent: bool,
}

impl Outbox {
    /// An outbox that validates every payload with `schemas`; an event type with
    /// no schema is refused.
    pub fn new(schemas: SchemaRegistry) -> Self {
        Self {
            schemas: Some(schemas),
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            persistent: true,
        }
    }

    /// An outbox that writes payloads without schema validation. Envelope
    /// attributes are still validated. Meant for tests and for events whose
    /// payloads were validated elsewhere.
    pub fn unvalidated() -> Self {
        Self {
            schemas: None,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            persistent: true,
        }
    }

    /// Refuses an event whose NATS message would be larger than `bytes`
    /// (default [`DEFAULT_MAX_MESSAGE_SIZE`], 1 MiB). Set it to the server's
    /// `max_payload` if that is not the default.
    ///
    /// The size is [`Envelope::message_size`]: the CloudEvents JSON with the
    /// `sequence` the relay adds, plus the NATS headers the relay sends, with
    /// `data` measured as the relay sends it (PostgreSQL's `jsonb` text, which
    /// is longer than compact JSON: spaces after `:` and `,`, numbers written
    /// out in full).
    #[must_use]
    pub fn max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// Whether the insert is a named prepared statement, kept on the
    /// connection and reused (sqlx's `persistent`, the default), or an unnamed
    /// one, parsed each time.
    ///
    /// Set `false` behind a transaction pooler that does not track prepared
    /// statements (PgBouncer before 1.21 in `pool_mode = transaction`): there a
    /// named statement prepared in one transaction is missing, or another
    /// client's, in the next. Every other query of the service's pool must be
    /// unnamed there too (`.persistent(false)`). See [`crate::pooler`].
    #[must_use]
    pub fn persistent(mut self, persistent: bool) -> Self {
        self.persistent = persistent;
        self
    }

    /// The registry payloads are checked against, if any.
    pub fn schemas(&self) -> Option<&SchemaRegistry> {
        self.schemas.as_ref()
    }

    /// Appends one event. It becomes visible to the relay when `tx` commits and
    /// disappears if `tx` rolls back.
    ///
    /// With the `opentelemetry` feature, an event that carries no trace
    /// context is written with that of the current `tracing` span
    /// (`trace_context::TraceContext::current`),
    /// so its consumers' spans join the writer's trace; without an
    /// OpenTelemetry layer installed there is none, and none is written.
    ///
    /// Nothing is written, and no statement is sent, if the event cannot be
    /// published or decoded; the error names the event and the reason.
    ///
    /// # Errors
    /// - [`ErrorKind::InvalidEnvelope`] if the `time` year is outside
    ///   `1..=9999`, the `traceparent` or `tracestate` is malformed
    ///   ([`Envelope::validate`]), or the payload is not JSON that consumers can
    ///   decode ([`check_json_decodable`](crate::check_json_decodable): a number
    ///   beyond a 64-bit float, nesting deeper than
    ///   [`MAX_JSON_DEPTH`](crate::MAX_JSON_DEPTH)). (An event type in a NATS
    ///   reserved namespace cannot be built in the first place.)
    /// - [`ErrorKind::TooLarge`] if the message exceeds
    ///   [`Outbox::max_message_size`].
    /// - [`ErrorKind::Serialization`] if the payload is not JSON-serializable.
    /// - [`ErrorKind::UnknownEventType`] / [`ErrorKind::SchemaViolation`] if it
    ///   fails its schema.
    /// - [`ErrorKind::Database`] if the insert fails (the transaction is then
    ///   aborted, as with any failed statement).
    pub async fn enqueue<T: Serialize>(
        &self,
        tx: &mut PgTransaction<'_>,
        event: &Envelope<T>,
    ) -> Result<EventId> {
        let ids = self.enqueue_all(tx, std::slice::from_ref(event)).await?;
        Ok(ids[0])
    }

    /// Appends many events in one statement (one round trip, whatever the count).
    /// All are validated first; if any fails, none is written. Events without
    /// a trace context take the current span's, as in [`Outbox::enqueue`].
    ///
    /// # Errors
    /// As [`Outbox::enqueue`]; a validation error names the failing event type.
    pub async fn enqueue_all<T: Serialize>(
        &self,
        tx: &mut PgTransaction<'_>,
        events: &[Envelope<T>],
    ) -> Result<Vec<EventId>> {
        let rows = Rows::build(self, events, false)?;
        if rows.ids.is_empty() {
            return Ok(Vec::new());
        }
        sqlx::query_file!(
            "queries/insert_events.sql",
            &rows.ids,
            &rows.event_types,
            &rows.sources,
            &rows.subjects,
            &rows.times,
            &rows.data,
            // Arrays whose elements may be NULL (the macro expects `&[String]`).
            &rows.traceparents as &[Option<String>],
            &rows.tracestates as &[Option<String>],
        )
        .persistent(self.persistent)
        .execute(&mut **tx)
        .await
        .map_err(|e| Error::database("inserting into outbox_events", e))?;
        Ok(events.iter().map(Envelope::id).collect())
    }
}

/// Bytes of the `scheduledfor` attribute on a scheduled event's message,
/// at its longest: `,"scheduledfor":"2026-12-06T08:00:00.123456Z"`.
const SCHEDULED_FOR_LEN: usize = 45;

/// Column arrays for the `unnest` insert.
#[derive(Default)]
pub(crate) struct Rows {
    pub(crate) ids: Vec<Uuid>,
    pub(crate) event_types: Vec<String>,
    pub(crate) sources: Vec<String>,
    pub(crate) subjects: Vec<String>,
    pub(crate) times: Vec<chrono::DateTime<chrono::Utc>>,
    pub(crate) data: Vec<serde_json::Value>,
    pub(crate) traceparents: Vec<Option<String>>,
    pub(crate) tracestates: Vec<Option<String>>,
}

impl Rows {
    /// Validates every event, then lays them out as columns. A `scheduled`
    /// event's message is measured with the `scheduledfor` attribute the
    /// relay adds.
    pub(crate) fn build<T: Serialize>(
        outbox: &Outbox,
        events: &[Envelope<T>],
        scheduled: bool,
    ) -> Result<Self> {
        let mut rows = Rows::default();
        let fallback = fallback(events);
        for event in events {
            let (traceparent, tracestate) = trace_of(event, &fallback);
            let event_type = event.event_type().as_str();
            let about = || format!("event {} of type `{event_type}`", event.id());
            event
                .validate()
                .map_err(|e| e.context(about()).with_event_type(event_type))?;
            let serialization = |e: serde_json::Error| {
                Error::new(
                    ErrorKind::Serialization,
                    format!("payload of event type `{event_type}` is not JSON-serializable: {e}"),
                )
                .with_event_type(event_type)
                .with_source(e)
            };
            let data = serde_json::to_value(event.data()).map_err(serialization)?;
            let text = serde_json::to_string(&data).map_err(serialization)?;
            check_json_decodable(&text)
                .map_err(|e| e.context(about()).with_event_type(event_type))?;
            // Measured as the relay will send it: the jsonb text of `data`
            // (see Envelope::message_size), not the compact text above.
            let size =
                event.message_size_with_trace(rendered_len(&data), traceparent, tracestate)?
                    + if scheduled { SCHEDULED_FOR_LEN } else { 0 };
            if size > outbox.max_message_size {
                return Err(Error::new(
                    ErrorKind::TooLarge,
                    format!(
                        "{} is too large to publish: its message is {size} bytes \
                         (CloudEvents JSON plus NATS headers), over the limit of {} bytes",
                        about(),
                        outbox.max_message_size
                    ),
                )
                .with_event_type(event_type));
            }
            if let Some(schemas) = &outbox.schemas {
                schemas.validate(event_type, &data)?;
            }
            rows.ids.push(*event.id().as_uuid());
            rows.event_types.push(event_type.to_owned());
            rows.sources.push(event.source().to_owned());
            rows.subjects.push(event.subject().to_owned());
            rows.times.push(event.time());
            rows.data.push(data);
            rows.traceparents.push(traceparent.map(str::to_owned));
            rows.tracestates.push(tracestate.map(str::to_owned));
        }
        Ok(rows)
    }
}

/// The `traceparent` and `tracestate` written on events that carry none: the
/// current span's (feature `opentelemetry`), read once per write; none
/// without the feature.
fn fallback<T>(events: &[Envelope<T>]) -> Option<(String, Option<String>)> {
    #[cfg(feature = "opentelemetry")]
    if events.iter().any(|e| e.traceparent().is_none()) {
        return crate::trace_context::TraceContext::current().map(|tc| tc.into_parts());
    }
    let _ = events;
    None
}

/// The `traceparent` and `tracestate` an event is written with: its own,
/// else the [`fallback`].
fn trace_of<'a, T>(
    event: &'a Envelope<T>,
    fallback: &'a Option<(String, Option<String>)>,
) -> (Option<&'a str>, Option<&'a str>) {
    match (event.traceparent(), fallback) {
        (Some(tp), _) => (Some(tp), event.tracestate()),
        (None, Some((tp, ts))) => (Some(tp.as_str()), ts.as_deref()),
        (None, None) => (None, None),
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use serde_json::{Value, json};

    use super::*;

    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn event(data: Value) -> Envelope<Value> {
        Envelope::new("orders.created", "orders", "order_1", data).unwrap()
    }

    fn refused(outbox: &Outbox, events: &[Envelope<Value>]) -> Error {
        match Rows::build(outbox, events, false) {
            Ok(_) => panic!("accepted"),
            Err(e) => e,
        }
    }

    fn nested(depth: usize) -> Value {
        (0..depth).fold(json!(1), |inner, _| json!([inner]))
    }

    #[test]
    fn valid_events_become_rows() {
        let events = [
            event(json!({"n": 1})),
            event(json!({"n": 2})).with_trace_context(TRACEPARENT.into(), Some("k=v".into())),
            event(nested(crate::MAX_JSON_DEPTH)),
        ];
        let rows = Rows::build(&Outbox::unvalidated(), &events, false).unwrap();
        assert_eq!(rows.ids.len(), 3);
    }

    #[cfg(feature = "opentelemetry")]
    #[test]
    fn an_event_without_a_trace_context_is_written_with_the_current_spans() {
        use opentelemetry::trace::TracerProvider as _;
        use tracing_subscriber::layer::SubscriberExt;

        use crate::trace_context::TraceContext;

        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("tests")));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("writer");
            let _entered = span.enter();
            let current = TraceContext::current().unwrap();
            let events = [
                event(json!({})),
                event(json!({})).with_trace_context(TRACEPARENT.into(), Some("k=v".into())),
            ];
            let rows = Rows::build(&Outbox::unvalidated(), &events, false).unwrap();
            assert_eq!(
                rows.traceparents,
                [
                    Some(current.traceparent().to_owned()),
                    Some(TRACEPARENT.to_owned())
                ]
            );
            assert_eq!(rows.tracestates, [None, Some("k=v".to_owned())]);
            assert_eq!(
                events[0].clone().with_current_trace_context().traceparent(),
                Some(current.traceparent())
            );

            // The size is measured with the context the row is written with.
            let bare = events[0].message_size().unwrap();
            let traced = events[0]
                .clone()
                .with_current_trace_context()
                .message_size()
                .unwrap();
            assert!(traced > bare, "{traced} vs {bare}");
            let err = refused(&Outbox::unvalidated().max_message_size(bare), &events[..1]);
            assert_eq!(err.kind(), ErrorKind::TooLarge);
        });
        // Outside any span with an OpenTelemetry context: none is written.
        let rows = Rows::build(&Outbox::unvalidated(), &[event(json!({}))], false).unwrap();
        assert_eq!(rows.traceparents, [None]);
        let bare = event(json!({}));
        assert_eq!(bare.with_current_trace_context().traceparent(), None);
    }

    #[test]
    fn header_unsafe_trace_context_is_refused_naming_the_event() {
        let outbox = Outbox::unvalidated();
        for (traceparent, tracestate, needle) in [
            (format!("{TRACEPARENT}\n"), None, "traceparent"),
            ("not-a-traceparent".to_owned(), None, "traceparent"),
            (TRACEPARENT.to_owned(), Some("k=v\r\nX: 1"), "tracestate"),
            (TRACEPARENT.to_owned(), Some("k=caf\u{e9}"), "tracestate"),
        ] {
            let bad =
                event(json!({})).with_trace_context(traceparent, tracestate.map(str::to_owned));
            let err = refused(&outbox, std::slice::from_ref(&bad));
            assert_eq!(err.kind(), ErrorKind::InvalidEnvelope);
            assert_eq!(err.event_type(), Some("orders.created"));
            let msg = err.to_string();
            assert!(
                msg.contains(needle) && msg.contains("orders.created"),
                "{msg}"
            );
            assert!(msg.contains(&bad.id().to_string()), "{msg}");
            assert!(!msg.contains('\n') && !msg.contains('\r'), "{msg:?}");
        }
    }

    #[test]
    fn a_time_beyond_four_digit_years_is_refused() {
        let time = chrono::Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap();
        let err = refused(&Outbox::unvalidated(), &[event(json!({})).with_time(time)]);
        assert_eq!(err.kind(), ErrorKind::InvalidEnvelope);
        assert!(err.to_string().contains("time"), "{err}");
    }

    #[test]
    fn data_nested_too_deep_is_refused() {
        let err = refused(
            &Outbox::unvalidated(),
            &[event(nested(crate::MAX_JSON_DEPTH + 1))],
        );
        assert_eq!(err.kind(), ErrorKind::InvalidEnvelope);
        assert!(err.to_string().contains("data"), "{err}");
    }

    #[test]
    fn a_message_over_the_limit_is_too_large() {
        let big = event(json!({"blob": "x".repeat(DEFAULT_MAX_MESSAGE_SIZE)}));
        let err = refused(&Outbox::unvalidated(), &[event(json!({})), big.clone()]);
        assert_eq!(err.kind(), ErrorKind::TooLarge);
        assert_eq!(err.event_type(), Some("orders.created"));
        let size = big.message_size().unwrap();
        let msg = err.to_string();
        assert!(
            msg.contains("orders.created")
                && msg.contains(&format!("{size} bytes"))
                && msg.contains("1048576 bytes"),
            "{msg}"
        );
    }

    #[test]
    fn the_size_is_that_of_the_jsonb_text_the_relay_sends() {
        // Compact: `[1,1,…]` and `1e300`; jsonb text: `[1, 1, …]` and 301 digits.
        let env = event(json!({"ones": vec![1; 1000], "big": 1e300}));
        let compact = serde_json::to_string(env.data()).unwrap().len();
        let rendered = r#"{"big": , "ones": []}"#.len() + 301 + 1000 + 999 * 2;
        let size = env.message_size().unwrap();
        let around = env.message_size_with_data_len(0).unwrap();
        assert_eq!(size - around, rendered);
        assert!(rendered > compact + 1000, "{rendered} vs {compact}");
        // Compact JSON would fit the limit; the text the relay sends does not.
        let limit = around + compact + 10;
        let err = refused(&Outbox::unvalidated().max_message_size(limit), &[env]);
        assert_eq!(err.kind(), ErrorKind::TooLarge);
    }

    #[test]
    fn the_limit_is_inclusive_and_configurable() {
        let env = event(json!({"blob": "x".repeat(1000)}));
        let size = env.message_size().unwrap();
        Rows::build(
            &Outbox::unvalidated().max_message_size(size),
            std::slice::from_ref(&env),
            false,
        )
        .unwrap();
        let err = refused(&Outbox::unvalidated().max_message_size(size - 1), &[env]);
        assert_eq!(err.kind(), ErrorKind::TooLarge);
        assert!(
            err.to_string()
                .contains(&format!("limit of {} bytes", size - 1)),
            "{err}"
        );
    }
}
