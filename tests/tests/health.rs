//! The libraries' readiness checks and the consumer's lag gauges, against a
//! real PostgreSQL and nats-server:
//!
//! - `outbox_publisher::Readiness` names a missing stream, then a broker
//!   that went away (the stream then "not checked"), and is ready in between;
//! - `inbox_consumer::Readiness` names a missing durable consumer;
//! - the database check fails within its bound when PostgreSQL is down;
//! - a running consumer exports `inbox_pending_messages` and
//!   `inbox_ack_pending_messages` as JetStream counts them.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use inbox_consumer::{BoxError, Consumer, ConsumerConfig, Delivery, Outcome};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use outbox_pg::Envelope;
use outbox_pg::health::Report;
use outbox_testkit::{NatsServer, PgServer, TestDb, wait_until};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

async fn create_stream(js: &jetstream::Context, name: &str, subjects: &[&str]) {
    js.create_stream(stream::Config {
        name: name.into(),
        subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
        ..Default::default()
    })
    .await
    .unwrap();
}

fn error_of<'a>(report: &'a Report, check: &str) -> &'a str {
    report
        .check(check)
        .unwrap_or_else(|| panic!("no `{check}` check in {report:?}"))
        .error()
        .unwrap_or_else(|| panic!("`{check}` passed: {report}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_readiness_names_a_missing_stream_then_a_broker_gone() {
    let db = TestDb::new().await.unwrap();
    let mut broker = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    let client = async_nats::connect(broker.url()).await.unwrap();
    let readiness =
        outbox_publisher::Readiness::new(db.pool.clone(), client.clone(), "HEALTH_RELAY");

    let report = readiness.check().await;
    assert!(!report.is_ready(), "{report}");
    assert!(report.check("database").unwrap().ok(), "{report}");
    assert!(report.check("broker").unwrap().ok(), "{report}");
    assert!(
        error_of(&report, "stream").contains("HEALTH_RELAY"),
        "{report}"
    );
    assert_eq!(report.to_json()["ready"], false);

    create_stream(&jetstream::new(client), "HEALTH_RELAY", &["health.>"]).await;
    let report = readiness.check().await;
    assert!(report.is_ready(), "{report}");
    assert_eq!(report.to_json()["checks"]["stream"]["ok"], true);

    tokio::task::block_in_place(|| broker.kill()).unwrap();
    let deadline = Instant::now() + WAIT;
    let report = loop {
        let report = readiness.check().await;
        if report.check("broker").is_some_and(|c| !c.ok()) {
            break report;
        }
        assert!(Instant::now() < deadline, "still {report} after {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        error_of(&report, "broker").contains("not connected to NATS"),
        "{report}"
    );
    assert!(
        error_of(&report, "stream").contains("not checked"),
        "{report}"
    );
    assert!(report.check("database").unwrap().ok(), "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_readiness_names_a_missing_durable() {
    let db = TestDb::new().await.unwrap();
    let broker = outbox_testkit::nats().unwrap();
    let client = async_nats::connect(broker.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    create_stream(&js, "HEALTH_CONSUMER", &["hc.>"]).await;
    let readiness = inbox_consumer::Readiness::new(
        db.pool.clone(),
        client,
        "HEALTH_CONSUMER",
        "health-durable",
    );

    let report = readiness.check().await;
    assert!(!report.is_ready(), "{report}");
    assert!(report.check("stream").unwrap().ok(), "{report}");
    assert!(
        error_of(&report, "consumer").contains("health-durable"),
        "{report}"
    );

    Consumer::new(
        db.pool.clone(),
        js,
        ConsumerConfig::new("HEALTH_CONSUMER", "health-durable"),
    )
    .await
    .unwrap();
    let report = readiness.check().await;
    assert!(report.is_ready(), "{report}");
    let names: Vec<_> = report.checks().iter().map(|c| c.name()).collect();
    assert_eq!(names, ["database", "broker", "stream", "consumer"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_check_fails_within_its_bound_when_postgres_is_down() {
    let mut pg = tokio::task::spawn_blocking(PgServer::start)
        .await
        .unwrap()
        .unwrap();
    let db = TestDb::on(&pg).await.unwrap();
    let broker = outbox_testkit::nats().unwrap();
    let client = async_nats::connect(broker.url()).await.unwrap();
    let readiness = outbox_publisher::Readiness::new(db.pool.clone(), client, "HEALTH_DB")
        .timeout(Duration::from_millis(500));
    assert!(readiness.check().await.check("database").unwrap().ok());

    tokio::task::block_in_place(|| pg.stop()).unwrap();
    let started = Instant::now();
    let report = readiness.check().await;
    let took = started.elapsed();
    assert!(!error_of(&report, "database").is_empty(), "{report}");
    assert!(
        took < Duration::from_secs(3),
        "the check took {took:?}, its bound is 500 ms per check"
    );
}

/// The process-wide recorder of this test binary.
fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().unwrap();
        snapshotter
    })
}

/// The gauges set since the last snapshot (this recorder's reads reset
/// them), labelled `consumer`: name → value.
fn gauges(consumer: &str) -> BTreeMap<String, f64> {
    snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let key = key.key();
            let ours = key
                .labels()
                .any(|l| l.key() == "consumer" && l.value() == consumer);
            match value {
                DebugValue::Gauge(v) if ours => Some((key.name().to_owned(), v.0)),
                _ => None,
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_consumer_exports_its_lag() {
    snapshotter();
    let db = TestDb::new().await.unwrap();
    let broker = outbox_testkit::nats().unwrap();
    let client = async_nats::connect(broker.url()).await.unwrap();
    let js = jetstream::new(client);
    create_stream(&js, "HEALTH_LAG", &["lag.>"]).await;
    let publisher = js.clone();
    // A handler that never finishes: every delivered message stays unacked.
    let hang = tower::service_fn(|_: Delivery| async {
        std::future::pending::<Result<Outcome, BoxError>>().await
    });
    let consumer = Consumer::new(
        db.pool.clone(),
        js,
        ConsumerConfig::new("HEALTH_LAG", "lagger")
            .concurrency(2)
            .max_buffered(2),
    )
    .await
    .unwrap();
    let running = tokio::spawn(consumer.run(hang, std::future::pending()));
    for i in 0..5 {
        let event =
            Envelope::new("lag.created", "health-tests", format!("s{i}"), json!({})).unwrap();
        publisher
            .publish("lag.created", event.to_json().unwrap().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    // Read every LAG_INTERVAL: the durable holds 2, 3 wait.
    let seen = std::sync::Mutex::new(Vec::new());
    wait_until(
        "the lag gauges to count 2 messages held and 3 waiting",
        inbox_consumer::runtime::LAG_INTERVAL + WAIT,
        || {
            let now = gauges("lagger");
            let done = now.get("inbox_ack_pending_messages") == Some(&2.0)
                && now.get("inbox_pending_messages") == Some(&3.0);
            seen.lock().unwrap().push(now);
            async move { done }
        },
    )
    .await
    .unwrap_or_else(|e| {
        let seen = seen.lock().unwrap();
        let set: Vec<_> = seen
            .iter()
            .filter(|g| g.values().any(|v| *v != 0.0))
            .collect();
        panic!("{e}: gauges set {set:?}")
    });
    running.abort();
}
