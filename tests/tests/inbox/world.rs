//! The world of the inbox tests: a database with an effects table, a broker
//! with a stream, a handler whose behaviour the payload picks, and a metrics
//! recorder that keeps counters per consumer.
#![allow(dead_code, unreachable_pub)] // each test binary uses its own part

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use futures::future::BoxFuture;
use inbox_consumer::{
    BatchHandler, Consumer, ConsumerConfig, Dedupe, DedupeLayer, Delivery, Handler, HandlerError,
    HandlerService, InTx, Metrics, MetricsLayer, Outcome, RetryPolicy, Router, Trace, TraceLayer,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use outbox_pg::{Envelope, Outbox};
use outbox_testkit::{NatsHandle, TestDb, wait_until};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{PgPool, PgTransaction};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::{Service, ServiceBuilder};

pub(crate) const WAIT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------
// Metrics: metrics-util's debugging recorder, its counters summed up by name
// and label set (a snapshot drains them), so parallel tests (each with its
// own consumer name) read only their own, as often as they like.

/// A counter series: its name and sorted `key=value` labels.
type Series = (String, Vec<String>);

/// Counter totals by series.
static TOTALS: LazyLock<Mutex<HashMap<Series, u64>>> = LazyLock::new(Default::default);

fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        // Another test of this binary may have set one first; then no
        // counter of this module's is read.
        let _ = metrics::set_global_recorder(recorder);
        snapshotter
    })
}

pub(crate) fn install_recorder() {
    snapshotter();
}

/// The sum of counter `name` over every label set with `consumer=<consumer>`.
pub(crate) fn counter(name: &str, consumer: &str) -> u64 {
    let mut totals = TOTALS.lock().unwrap();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        if let DebugValue::Counter(n) = value {
            let mut labels: Vec<String> = key
                .key()
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            *totals
                .entry((key.key().name().to_owned(), labels))
                .or_default() += n;
        }
    }
    let label = format!("consumer={consumer}");
    totals
        .iter()
        .filter(|((n, labels), _)| n == name && labels.contains(&label))
        .map(|(_, total)| total)
        .sum()
}

// ---------------------------------------------------------------------------
// The world: a database with an effects table, a broker with a stream.

pub(crate) struct World {
    pub(crate) db: TestDb,
    pub(crate) _nats: NatsHandle,
    pub(crate) js: jetstream::Context,
    pub(crate) stream: String,
}

/// The table [`Record`] writes its effects to.
pub(crate) async fn create_effects(pool: &PgPool) {
    sqlx::query(
        "create table effects (
           n        bigserial primary key,
           consumer text not null,
           event_id uuid not null,
           subject  text not null,
           seq      bigint not null,
           replica  text not null
         )",
    )
    .execute(pool)
    .await
    .unwrap();
}

pub(crate) async fn world(stream: &str) -> World {
    install_recorder();
    let db = TestDb::new().await.unwrap();
    create_effects(&db.pool).await;
    let nats = outbox_testkit::nats().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: stream.into(),
        subjects: vec!["t.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    World {
        db,
        _nats: nats,
        js,
        stream: stream.into(),
    }
}

impl World {
    pub(crate) async fn count(&self, sql: &str) -> i64 {
        crate::support::count(&self.db.pool, sql).await
    }

    pub(crate) async fn publish_raw(&self, subject: &str, body: Vec<u8>, msg_id: &str) {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
        self.js
            .publish_with_headers(subject.to_owned(), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Publishes `event` as the relay does: body = envelope JSON, `Nats-Msg-Id` = id.
    pub(crate) async fn publish(&self, event: &Envelope<Value>) {
        let id = event.id().to_string();
        self.publish_raw(event.event_type().as_str(), event.to_json().unwrap(), &id)
            .await;
    }

    /// Publishes every event as [`publish`](Self::publish) does, all acks in
    /// flight at once, then waits for them.
    pub(crate) async fn publish_all(&self, events: &[Envelope<Value>]) {
        super::support::publish_envelopes(&self.js, events).await;
    }

    /// Messages of `durable` neither acked nor terminated yet (pending + unacked).
    pub(crate) async fn outstanding(&self, durable: &str) -> u64 {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        let info = stream.consumer_info(durable).await.unwrap();
        info.num_pending + info.num_ack_pending as u64
    }

    pub(crate) async fn wait_settled(&self, durable: &str) {
        wait_until("every message acked or terminated", WAIT, || async {
            self.outstanding(durable).await == 0
        })
        .await
        .unwrap();
    }

    pub(crate) async fn wait_count(&self, what: &str, sql: &str, n: i64) {
        wait_until(what, WAIT, || async { self.count(sql).await >= n })
            .await
            .unwrap();
    }
}

pub(crate) fn event(event_type: &str, subject: &str, data: Value) -> Envelope<Value> {
    Envelope::new(event_type, "tests", subject, data).unwrap()
}

/// A `t.ok` event the handler applies (mode `ok`).
pub(crate) fn ok(subject: &str, seq: i64) -> Envelope<Value> {
    event("t.ok", subject, json!({"seq": seq}))
}

/// Effects of `event` in the effects table (a rolled-back attempt leaves none).
pub(crate) async fn effects_of(w: &World, event: &Envelope<Value>) -> i64 {
    sqlx::query_scalar("select count(*) from effects where event_id = $1")
        .bind(event.id().as_uuid())
        .fetch_one(&w.db.pool)
        .await
        .unwrap()
}

// ---------------------------------------------------------------------------
// One handler whose behaviour the payload picks.

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Mode {
    #[default]
    Ok,
    /// Fail (retry) the first attempt, succeed afterwards.
    FailOnce,
    /// Always fail with a retryable error.
    AlwaysFail,
    Reject,
    /// Enqueue a follow-on event, then fail once (retry) after it.
    EnqueueFailOnce,
    /// Enqueue a follow-on event, then reject.
    EnqueueReject,
    /// Hold the transaction for a while.
    Slow,
    /// Hold the transaction for 1.2 s: longer than a 1 s ack wait.
    Slower,
    /// Sleep this many milliseconds outside the database, inside the
    /// transaction (a handler waiting on something else), then write.
    SleepMs(u64),
    /// Stall 0.9 s between two statements, idle inside the transaction.
    Stall,
    /// Swallow a failed statement and return Ok (a handler bug).
    SwallowError,
    /// Panic after writing the effect: an `expect` on a field the event
    /// lacks (a handler bug), with [`PANIC_MESSAGE`].
    Panic,
}

/// The message of [`Mode::Panic`]'s panic.
pub(crate) const PANIC_MESSAGE: &str = "the event has a plan";

#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Payload {
    pub(crate) seq: i64,
    #[serde(default)]
    pub(crate) mode: Mode,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) attempts: Mutex<HashMap<String, usize>>,
    pub(crate) in_flight: AtomicUsize,
    pub(crate) max_in_flight: AtomicUsize,
    pub(crate) started: AtomicUsize,
    /// The events of each [`BatchHandler`] call, in call order.
    pub(crate) groups: Mutex<Vec<Vec<String>>>,
}

#[derive(Clone)]
pub(crate) struct Record {
    pub(crate) replica: &'static str,
    pub(crate) state: Arc<State>,
    pub(crate) outbox: Outbox,
}

impl Record {
    pub(crate) fn new(replica: &'static str) -> Self {
        Self {
            replica,
            state: Arc::default(),
            outbox: Outbox::unvalidated(),
        }
    }

    pub(crate) fn attempt(&self, event: &Envelope<Payload>) -> usize {
        let mut attempts = self.state.attempts.lock().unwrap();
        let n = attempts.entry(event.id().to_string()).or_default();
        *n += 1;
        *n
    }

    pub(crate) fn attempts(&self, event: &Envelope<Value>) -> usize {
        self.state
            .attempts
            .lock()
            .unwrap()
            .get(&event.id().to_string())
            .copied()
            .unwrap_or(0)
    }

    pub(crate) async fn apply(
        &self,
        event: &Envelope<Payload>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        let attempt = self.attempt(event);
        self.state.started.fetch_add(1, Ordering::SeqCst);
        sqlx::query(
            "insert into effects (consumer, event_id, subject, seq, replica)
             values ('', $1, $2, $3, $4)",
        )
        .bind(event.id().as_uuid())
        .bind(event.subject())
        .bind(event.data().seq)
        .bind(self.replica)
        .execute(&mut **tx)
        .await?;
        match event.data().mode {
            Mode::Ok => Ok(()),
            Mode::Slower => {
                sqlx::query("select pg_sleep(1.2)")
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }
            Mode::SleepMs(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                sqlx::query("select 1").execute(&mut **tx).await?;
                Ok(())
            }
            Mode::Stall => {
                tokio::time::sleep(Duration::from_millis(900)).await;
                sqlx::query("select 1").execute(&mut **tx).await?;
                Ok(())
            }
            Mode::Slow => {
                sqlx::query("select pg_sleep(0.3)")
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }
            Mode::SwallowError => {
                let _ = sqlx::query("select 1/0").execute(&mut **tx).await;
                Ok(())
            }
            Mode::Panic => {
                let plan: Option<&str> = std::hint::black_box(None);
                let _ = plan.expect(PANIC_MESSAGE);
                Ok(())
            }
            Mode::FailOnce if attempt == 1 => Err(HandlerError::retry("first attempt fails")),
            Mode::FailOnce => Ok(()),
            Mode::AlwaysFail => Err(HandlerError::retry("always fails")),
            Mode::Reject => Err(HandlerError::reject("this event is not acceptable")),
            Mode::EnqueueFailOnce | Mode::EnqueueReject => {
                let follow_on = Envelope::new(
                    "t.follow_on",
                    "tests",
                    event.subject(),
                    json!({"caused_by": event.id()}),
                )?;
                self.outbox.enqueue(tx, &follow_on).await?;
                match (&event.data().mode, attempt) {
                    (Mode::EnqueueFailOnce, 1) => Err(HandlerError::retry("fails after enqueue")),
                    (Mode::EnqueueFailOnce, _) => Ok(()),
                    _ => Err(HandlerError::reject("rejects after enqueue")),
                }
            }
        }
    }
}

impl Handler for Record {
    type Message = Payload;

    async fn handle(
        &self,
        event: Envelope<Payload>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        let now = self.state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.state.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let result = self.apply(&event, tx).await;
        self.state.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }
}

/// The same handler, a group at a time: each event applied in turn, in the
/// group's transaction, the group recorded.
impl BatchHandler for Record {
    type Message = Payload;

    async fn handle_batch(
        &self,
        events: Vec<Envelope<Payload>>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        let ids = events.iter().map(|e| e.id().to_string()).collect();
        self.state.groups.lock().unwrap().push(ids);
        for event in &events {
            self.apply(event, tx).await?;
        }
        Ok(())
    }
}

impl Record {
    /// The sizes of the [`BatchHandler`] calls so far.
    pub(crate) fn group_sizes(&self) -> Vec<usize> {
        self.state
            .groups
            .lock()
            .unwrap()
            .iter()
            .map(Vec::len)
            .collect()
    }
}

pub(crate) type InRouter = Router<InTx<Delivery>, InTx<Outcome>>;
pub(crate) type Stack = Trace<Metrics<Dedupe<InRouter>>>;

pub(crate) fn stack(pool: &PgPool, handler: Record) -> Stack {
    ServiceBuilder::new()
        .layer(TraceLayer::new())
        .layer(MetricsLayer::new())
        .layer(DedupeLayer::new(pool.clone()))
        .service(Router::new().route("t.ok", HandlerService::new(handler)))
}

/// [`stack`] with `t.ok` routed to the handler as a [`BatchHandler`].
pub(crate) fn batch_stack(pool: &PgPool, handler: Record) -> Stack {
    ServiceBuilder::new()
        .layer(TraceLayer::new())
        .layer(MetricsLayer::new())
        .layer(DedupeLayer::new(pool.clone()))
        .service(Router::new().route_batch_handler("t.ok", handler))
}

pub(crate) fn config(world: &World, durable: &str) -> ConsumerConfig {
    ConsumerConfig::new(&world.stream, durable)
        .ack_wait(Duration::from_secs(10))
        .max_deliver(5)
        .retry(
            RetryPolicy::default()
                .base(Duration::from_millis(50))
                .max(Duration::from_millis(200)),
        )
}

pub(crate) struct Running {
    pub(crate) stop: Option<oneshot::Sender<()>>,
    pub(crate) task: JoinHandle<inbox_consumer::Result<()>>,
}

impl Running {
    pub(crate) async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(WAIT, &mut self.task)
            .await
            .expect("graceful shutdown finishes")
            .unwrap()
            .unwrap();
    }
}

pub(crate) async fn start<S>(world: &World, config: ConsumerConfig, service: S) -> Running
where
    S: Service<Delivery, Response = Outcome> + Clone + Send + 'static,
    S::Error: Into<inbox_consumer::BoxError>,
    S::Future: Send + 'static,
{
    spawn(world, config, |consumer, stopped| {
        consumer.run(service, stopped)
    })
    .await
}

/// [`start`] for a batch service, with [`Consumer::run_batched`].
pub(crate) async fn start_batched<S>(world: &World, config: ConsumerConfig, service: S) -> Running
where
    S: Service<Vec<Delivery>, Response = inbox_consumer::BatchResults> + Clone + Send + 'static,
    S::Error: Into<inbox_consumer::BoxError>,
    S::Future: Send + 'static,
{
    spawn(world, config, |consumer, stopped| {
        consumer.run_batched(service, stopped)
    })
    .await
}

/// Creates the consumer and spawns `run` on it, stopped by [`Running::shutdown`].
async fn spawn<F>(
    world: &World,
    config: ConsumerConfig,
    run: impl FnOnce(Consumer, BoxFuture<'static, ()>) -> F,
) -> Running
where
    F: std::future::Future<Output = inbox_consumer::Result<()>> + Send + 'static,
{
    let consumer = Consumer::new(world.db.pool.clone(), world.js.clone(), config)
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let stopped: BoxFuture<'static, ()> = Box::pin(async {
        let _ = stopped.await;
    });
    Running {
        stop: Some(stop),
        task: tokio::spawn(run(consumer, stopped)),
    }
}
