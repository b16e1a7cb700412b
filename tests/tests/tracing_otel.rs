//! One trace from a write to its handler, through `tracing-opentelemetry`,
//! against real PostgreSQL and nats-server: a writer's span enqueues an event
//! in its transaction (the outbox takes the span's trace context), the relay
//! publishes the row with its `traceparent` header, and the consumer runtime
//! with the `Trace` layer handles it in an `inbox.delivery` span whose
//! OpenTelemetry parent is the writer's span; the handler's own span is that
//! span's child. Spans are exported to memory as they end
//! (`opentelemetry_sdk`'s `InMemorySpanExporter`), and the test reads the
//! parent chain from them. Single and batch mode, and the subscriptions
//! service's request span reaching the row.

use std::sync::OnceLock;
use std::time::Duration;

use async_nats::jetstream;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use inbox_consumer::{
    Consumer, ConsumerConfig, DedupeLayer, Delivery, Handler, HandlerError, HandlerService, InTx,
    Outcome, Router, TraceLayer,
};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox_pg::{Envelope, EventId, Outbox, SchemaRegistry};
use outbox_publisher::{Relay, RelayConfig, StreamSpec};
use outbox_testkit::{NatsHandle, TestDb, wait_until};
use serde_json::{Value, json};
use sqlx::PgTransaction;
use tokio_util::sync::CancellationToken;
use tower::{ServiceBuilder, ServiceExt};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

const WAIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------
// Spans: one process-wide subscriber bridging every span to OpenTelemetry,
// exported to memory as each ends. Tests tell theirs apart by trace id.

fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("tests")));
        tracing::subscriber::set_global_default(subscriber).unwrap();
        exporter
    })
}

/// The ended spans of `trace`.
fn spans_of(trace: TraceId) -> Vec<SpanData> {
    exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|s| s.span_context.trace_id() == trace)
        .collect()
}

/// Waits until `trace` has ended spans named `names` (at least `n` of each).
async fn wait_for_spans(trace: TraceId, names: &[&str], n: usize) -> Vec<SpanData> {
    wait_until("the trace's spans ended", WAIT, || async {
        let spans = spans_of(trace);
        names
            .iter()
            .all(|name| spans.iter().filter(|s| s.name == *name).count() >= n)
    })
    .await
    .unwrap();
    spans_of(trace)
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|s| s.name == name).collect()
}

/// `traceparent` of a span context, as the W3C propagator writes it.
fn traceparent(cx: &SpanContext) -> String {
    format!("00-{}-{}-01", cx.trace_id(), cx.span_id())
}

// ---------------------------------------------------------------------------
// The world: a database, a broker, a relay's stream, and a handler that opens
// a span of its own.

struct World {
    db: TestDb,
    _nats: NatsHandle,
    client: async_nats::Client,
    js: jetstream::Context,
    stream: String,
}

async fn world(stream: &str) -> World {
    exporter();
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    World {
        db,
        _nats: nats,
        js: jetstream::new(client.clone()),
        client,
        stream: stream.into(),
    }
}

impl World {
    fn spec(&self) -> StreamSpec {
        StreamSpec::new(self.stream.clone(), vec!["t.>".into()])
    }

    /// Enqueues one event inside a `writer` span, in a transaction, with no
    /// trace context of its own; the writer span's context and the event id.
    async fn write(&self, subject: &str) -> (SpanContext, EventId) {
        let writer = tracing::info_span!("writer", subject);
        let event = Envelope::new("t.traced", "tests", subject, json!({})).unwrap();
        assert_eq!(event.traceparent(), None);
        let id = async {
            let mut tx = self.db.pool.begin().await.unwrap();
            let id = Outbox::unvalidated()
                .enqueue(&mut tx, &event)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            id
        }
        .instrument(writer.clone())
        .await;
        let cx = writer.context().span().span_context().clone();
        assert!(cx.is_valid());
        (cx, id)
    }

    async fn row_traceparent(&self, id: EventId) -> Option<String> {
        sqlx::query_scalar("select traceparent from outbox_events where id = $1")
            .bind(id.as_uuid())
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// Publishes every row in process, as `outbox-relay --once` would.
    async fn relay(&self, rows: usize) {
        let relay = Relay::jetstream(
            self.db.pool.clone(),
            self.client.clone(),
            &self.spec(),
            RelayConfig::default(),
        )
        .await
        .unwrap();
        assert_eq!(relay.drain().await.unwrap().published, rows);
    }

    /// The `traceparent` header of the stream's message of `subject`.
    async fn header(&self, subject: &str) -> Option<String> {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let mut messages = Vec::new();
        let info = stream.get_info().await.unwrap();
        for seq in info.state.first_sequence..=info.state.last_sequence {
            messages.push(stream.get_raw_message(seq).await.unwrap());
        }
        let message = messages
            .into_iter()
            .find(|m| {
                Envelope::<Value>::from_json(&m.payload)
                    .unwrap()
                    .subject()
                    .eq(subject)
            })
            .unwrap();
        message
            .headers
            .get("traceparent")
            .map(|v| v.as_str().to_owned())
    }

    fn consumer_config(&self, durable: &str) -> ConsumerConfig {
        ConsumerConfig::new(&self.stream, durable)
    }

    async fn consumer(&self, config: ConsumerConfig) -> Consumer {
        Consumer::new(self.db.pool.clone(), self.js.clone(), config)
            .await
            .unwrap()
    }
}

/// Handles each event in a `handler` span of its own, with a statement in
/// the transaction.
#[derive(Clone)]
struct Traced;

impl Handler for Traced {
    type Message = Value;

    async fn handle(
        &self,
        event: Envelope<Value>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        async {
            sqlx::query("select 1").execute(&mut **tx).await?;
            Ok(())
        }
        .instrument(tracing::info_span!("handler", event_id = %event.id()))
        .await
    }
}

type Stack = inbox_consumer::Trace<inbox_consumer::Dedupe<Router<InTx<Delivery>, InTx<Outcome>>>>;

fn stack(w: &World) -> Stack {
    ServiceBuilder::new()
        .layer(TraceLayer::new())
        .layer(DedupeLayer::new(w.db.pool.clone()))
        .service(Router::new().route("t.traced", HandlerService::new(Traced)))
}

/// Asserts that `handler` descends from `writer` through an `inbox.delivery`
/// span: handler → delivery → writer, all in the writer's trace.
fn assert_descends(spans: &[SpanData], writer: &SpanContext) {
    let delivery = named(spans, "inbox.delivery")
        .into_iter()
        .find(|d| d.parent_span_id == writer.span_id())
        .unwrap_or_else(|| panic!("no inbox.delivery span child of {writer:?}: {spans:#?}"));
    assert_eq!(delivery.span_context.trace_id(), writer.trace_id());
    assert!(delivery.parent_span_is_remote, "the parent came by message");
    let handler = named(spans, "handler")
        .into_iter()
        .find(|h| h.parent_span_id == delivery.span_context.span_id())
        .unwrap_or_else(|| panic!("no handler span child of the delivery: {spans:#?}"));
    assert_eq!(handler.span_context.trace_id(), writer.trace_id());
    // The writer's own span was exported too, with the id the row names.
    let exported = named(spans, "writer");
    assert!(
        exported
            .iter()
            .any(|w| w.span_context.span_id() == writer.span_id()),
        "{exported:#?}"
    );
}

// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_handlers_span_is_in_the_trace_of_the_span_that_wrote_the_event() {
    let w = world("TRACE_ONE").await;
    let (writer, id) = w.write("sub_1").await;

    // The row, then the message header, carry the writer span's context.
    let expected = traceparent(&writer);
    assert_eq!(
        w.row_traceparent(id).await.as_deref(),
        Some(expected.as_str())
    );
    w.relay(1).await;
    assert_eq!(w.header("sub_1").await.as_deref(), Some(expected.as_str()));

    let consumer = w.consumer(w.consumer_config("traced")).await;
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run(stack(&w), stop.clone().cancelled_owned()));
    wait_for_spans(writer.trace_id(), &["handler"], 1).await;
    stop.cancel();
    tokio::time::timeout(WAIT, running)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let spans = wait_for_spans(
        writer.trace_id(),
        &["writer", "inbox.delivery", "handler"],
        1,
    )
    .await;

    assert_descends(&spans, &writer);
    let delivery = named(&spans, "inbox.delivery")[0];
    assert!(
        delivery
            .attributes
            .iter()
            .any(|kv| kv.key.as_str() == "traceparent" && kv.value.as_str() == expected),
        "the field recording stays: {:?}",
        delivery.attributes
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn in_a_batch_each_handler_is_in_the_trace_of_its_own_writer() {
    let w = world("TRACE_BATCH").await;
    let (first, _) = w.write("sub_1").await;
    let (second, _) = w.write("sub_2").await;
    assert_ne!(
        first.trace_id(),
        second.trace_id(),
        "two writes, two traces"
    );
    w.relay(2).await;

    let consumer = w
        .consumer(w.consumer_config("traced_batch").max_batch(8))
        .await;
    let stop = CancellationToken::new();
    let running = tokio::spawn(consumer.run_batched(stack(&w), stop.clone().cancelled_owned()));
    wait_for_spans(first.trace_id(), &["handler"], 1).await;
    wait_for_spans(second.trace_id(), &["handler"], 1).await;
    stop.cancel();
    tokio::time::timeout(WAIT, running)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let spans = ["writer", "inbox.delivery", "handler"];
    let first_spans = wait_for_spans(first.trace_id(), &spans, 1).await;
    let second_spans = wait_for_spans(second.trace_id(), &spans, 1).await;

    assert_descends(&first_spans, &first);
    assert_descends(&second_spans, &second);
    // Every batch span is linked to the writers of its deliveries.
    let linked: Vec<SpanId> = exporter()
        .get_finished_spans()
        .unwrap()
        .iter()
        .filter(|s| s.name == "inbox.batch")
        .flat_map(|s| s.links.iter().map(|l| l.span_context.span_id()))
        .collect();
    for writer in [&first, &second] {
        assert!(linked.contains(&writer.span_id()), "{linked:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_subscriptions_request_span_reaches_the_row_in_the_callers_trace() {
    exporter();
    let db = TestDb::new().await.unwrap();
    example_subscriptions::migrate(&db.pool).await.unwrap();
    let schemas = SchemaRegistry::from_dir(example_subscriptions::default_schemas_dir()).unwrap();
    let app = example_subscriptions::router(example_subscriptions::AppState::new(
        db.pool.clone(),
        Outbox::new(schemas),
    ));
    let caller_trace = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    let caller_span = SpanId::from_hex("00f067aa0ba902b7").unwrap();
    let request = Request::post("/v1/subscriptions")
        .header("content-type", "application/json")
        .header("traceparent", format!("00-{caller_trace}-{caller_span}-01"))
        .body(Body::from(
            json!({"customer_id": "cus_1", "plan": "pro", "amount_cents": 1234}).to_string(),
        ))
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);

    let spans = wait_for_spans(caller_trace, &["http.request"], 1).await;
    let request_span = named(&spans, "http.request")
        .into_iter()
        .find(|s| s.parent_span_id == caller_span)
        .unwrap();
    let row: String = sqlx::query_scalar(
        "select traceparent from outbox_events where event_type = 'subscription.created'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(row, traceparent(&request_span.span_context));
}
