//! The relay against real PostgreSQL and nats-server: delivery, ordering across
//! replicas and broker restarts, backoff, poison rows, retention, wake-ups.

use std::collections::{HashMap, HashSet};
use std::sync::OnceLock;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream::StorageType};
use futures::StreamExt;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use outbox_pg::{Envelope, Outbox};
use outbox_publisher::{ErrorKind, JetStreamSink, Relay, RelayConfig, Sink, StreamSpec};
use outbox_testkit::{NatsServer, TestDb, nats, wait_until};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const SUBJECTS: &[&str] = &["orders.>", "billing.>"];

fn snapshotter() -> &'static Snapshotter {
    static SNAP: OnceLock<Snapshotter> = OnceLock::new();
    SNAP.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::set_global_recorder(recorder).unwrap();
        snapshotter
    })
}

fn counter(name: &str) -> u64 {
    snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, _, _, _)| key.key().name() == name)
        .map(|(_, _, _, value)| match value {
            DebugValue::Counter(n) => n,
            _ => 0,
        })
        .sum()
}

fn stream_spec(name: &str) -> StreamSpec {
    StreamSpec::new(name, SUBJECTS.iter().map(|s| s.to_string()).collect())
}

/// Fast retries so fault tests finish in seconds.
fn fast_config() -> RelayConfig {
    RelayConfig::default()
        .poll_interval(Duration::from_millis(50))
        .backoff_base(Duration::from_millis(100))
        .backoff_max(Duration::from_millis(800))
        .publish_timeout(Duration::from_millis(500))
        .lease(Duration::from_secs(3))
}

async fn connect(url: &str) -> async_nats::Client {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connect(url)
        .await
        .unwrap();
    wait_until("NATS connection", Duration::from_secs(10), || async {
        client.connection_state() == async_nats::connection::State::Connected
    })
    .await
    .unwrap();
    client
}

async fn relay(db: &TestDb, url: &str, stream: &str, config: RelayConfig) -> Relay {
    Relay::jetstream(
        db.pool.clone(),
        connect(url).await,
        &stream_spec(stream),
        config,
    )
    .await
    .unwrap()
}

fn event(event_type: &str, subject: &str, data: Value) -> Envelope<Value> {
    Envelope::new(event_type, "relay-tests", subject, data).unwrap()
}

async fn commit(db: &TestDb, events: &[Envelope<Value>]) {
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::unvalidated()
        .enqueue_all(&mut tx, events)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

async fn scalar(db: &TestDb, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn unpublished(db: &TestDb) -> i64 {
    scalar(
        db,
        "select count(*) from outbox_events where published_at is null",
    )
    .await
}

/// Every message of `stream`, in stream order.
async fn stream_messages(url: &str, stream: &str) -> Vec<jetstream::Message> {
    let js = jetstream::new(connect(url).await);
    let mut stream = js.get_stream(stream).await.unwrap();
    let total = stream.info().await.unwrap().state.messages as usize;
    if total == 0 {
        return Vec::new();
    }
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::with_capacity(total);
    while out.len() < total {
        let next = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("stream read timed out")
            .unwrap()
            .unwrap();
        out.push(next);
    }
    out
}

fn msg_id(message: &jetstream::Message) -> String {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get("Nats-Msg-Id"))
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default()
}

#[tokio::test]
async fn committed_events_arrive_once_with_envelope_and_msg_id() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let committed: Vec<_> = (0..3)
        .map(|i| {
            event("orders.created", &format!("order_{i}"), json!({"n": i})).with_trace_context(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                None,
            )
        })
        .collect();
    commit(&db, &committed).await;
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::unvalidated()
        .enqueue(
            &mut tx,
            &event("orders.created", "order_rolled_back", json!({})),
        )
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    let relay = relay(&db, broker.url(), "DELIVERY", fast_config()).await;
    let report = relay.drain().await.unwrap();
    assert_eq!((report.published, report.failed), (3, 0));

    let messages = stream_messages(broker.url(), "DELIVERY").await;
    assert_eq!(messages.len(), 3);
    // Different subjects: no order between them, so match by id.
    for message in &messages {
        let sent = committed
            .iter()
            .find(|e| e.id().to_string() == msg_id(message))
            .expect("a committed event");
        assert_eq!(message.subject.as_str(), "orders.created");
        let headers = message.headers.as_ref().unwrap();
        assert_eq!(
            headers.get("traceparent").map(|v| v.as_str()),
            sent.traceparent()
        );
        let received = Envelope::<Value>::from_json(&message.payload).unwrap();
        let sequence = received
            .sequence()
            .expect("every message carries `sequence`");
        assert_eq!(received, sent.clone().with_sequence(sequence));
    }
    assert_eq!(unpublished(&db).await, 0);
    assert_eq!(
        scalar(
            &db,
            "select count(*) from outbox_events where attempts = 0 and last_error is null"
        )
        .await,
        3
    );
    // Nothing leaked from the rolled-back transaction.
    assert!(
        messages
            .iter()
            .all(|m| !String::from_utf8_lossy(&m.payload).contains("rolled_back"))
    );
}

#[tokio::test]
async fn a_relay_killed_between_publish_and_mark_republishes_and_the_stream_stores_once() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let events: Vec<_> = (0..20)
        .map(|i| event("orders.created", &format!("o{}", i % 4), json!({"n": i})))
        .collect();
    commit(&db, &events).await;
    let relay = relay(&db, broker.url(), "CRASH", fast_config()).await;

    // The first relay publishes, then dies before marking: its rows stay
    // unpublished, and the next owner of their shards publishes them again.
    let sink = JetStreamSink::new(connect(broker.url()).await, Duration::from_secs(5));
    for e in &events {
        let ack = sink
            .publish(outbox_publisher::OutgoingMessage {
                id: e.id(),
                subject: e.event_type().to_string(),
                payload: e.to_json().unwrap().into(),
                traceparent: None,
                tracestate: None,
            })
            .await
            .unwrap();
        assert!(!ack.duplicate);
    }

    let report = relay.drain().await.unwrap();
    assert_eq!(report.published, 20);
    assert_eq!(
        report.duplicates, 20,
        "every republish is acked as a duplicate"
    );
    assert_eq!(unpublished(&db).await, 0);
    let messages = stream_messages(broker.url(), "CRASH").await;
    assert_eq!(messages.len(), 20, "the stream stored each event once");
    let ids: HashSet<String> = messages.iter().map(msg_id).collect();
    assert_eq!(ids.len(), 20);
}

#[tokio::test]
async fn broker_outage_costs_no_attempts_then_delivers_everything() {
    let db = TestDb::new().await.unwrap();
    let mut broker = NatsServer::start().unwrap();
    let url = broker.url();
    let relay = relay(&db, &url, "OUTAGE", fast_config()).await;
    let shutdown = CancellationToken::new();
    let running = {
        let shutdown = shutdown.clone();
        async move { relay.run(shutdown.cancelled_owned()).await }
    };
    let handle = tokio::spawn(running);

    broker.kill().unwrap();
    let events: Vec<_> = (0..30)
        .map(|i| {
            event(
                "billing.charged",
                &format!("acct_{}", i % 5),
                json!({"n": i}),
            )
        })
        .collect();
    commit(&db, &events).await;

    // The broker, not the rows, is at fault: rows wait with their attempts
    // untouched, however long the outage (here several times the whole
    // backoff budget of the fast config).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(unpublished(&db).await, 30);
    assert_eq!(
        scalar(
            &db,
            "select count(*) from outbox_events where attempts > 0 or next_attempt_at is not null"
        )
        .await,
        0,
        "a broker outage costs no attempts"
    );

    broker.start_again().unwrap();
    wait_until(
        "all delivered after the broker is back",
        Duration::from_secs(30),
        || async { unpublished(&db).await == 0 },
    )
    .await
    .unwrap();
    shutdown.cancel();
    handle.await.unwrap().unwrap();
    let messages = stream_messages(&url, "OUTAGE").await;
    let ids: HashSet<String> = messages.iter().map(msg_id).collect();
    assert_eq!(ids.len(), 30);
    assert_eq!(messages.len(), 30);
}

/// 3 replicas, 10,000 events over 200 subjects, the broker restarted mid-run:
/// every event stored once, and per subject the stream order is created_at order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_keep_subject_order_through_a_broker_restart() {
    const EVENTS: usize = 10_000;
    const SUBJECT_COUNT: usize = 200;
    let db = TestDb::new().await.unwrap();
    let mut broker = NatsServer::start().unwrap();
    let url = broker.url();

    let shutdown = CancellationToken::new();
    let mut handles = Vec::new();
    for _ in 0..3 {
        let relay = relay(&db, &url, "ORDERED", fast_config().batch_size(100)).await;
        let shutdown = shutdown.clone();
        handles.push(tokio::spawn(async move {
            relay.run(shutdown.cancelled_owned()).await
        }));
    }

    // Writers commit in many small transactions while the relays run.
    let mut seq_per_subject = vec![0u32; SUBJECT_COUNT];
    let mut restarted = false;
    for chunk in 0..(EVENTS / 100) {
        let events: Vec<_> = (0..100)
            .map(|i| {
                let s = (chunk * 100 + i * 7) % SUBJECT_COUNT;
                seq_per_subject[s] += 1;
                event(
                    "orders.updated",
                    &format!("order_{s}"),
                    json!({"seq": seq_per_subject[s]}),
                )
            })
            .collect();
        commit(&db, &events).await;
        if chunk == EVENTS / 200 && !restarted {
            broker.restart().unwrap();
            restarted = true;
        }
    }
    wait_until("all 10,000 published", Duration::from_secs(120), || async {
        unpublished(&db).await == 0
    })
    .await
    .unwrap();
    shutdown.cancel();
    for h in handles {
        h.await.unwrap().unwrap();
    }

    let messages = stream_messages(&url, "ORDERED").await;
    assert_eq!(messages.len(), EVENTS, "each event stored exactly once");
    let ids: HashSet<String> = messages.iter().map(msg_id).collect();
    assert_eq!(ids.len(), EVENTS);

    // Per subject, stream order must equal created_at order (then id).
    let rows: Vec<(Uuid, String)> =
        sqlx::query_as("select id, subject from outbox_events order by created_at, id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for (id, subject) in rows {
        expected.entry(subject).or_default().push(id.to_string());
    }
    let mut actual: HashMap<String, Vec<String>> = HashMap::new();
    for m in &messages {
        let env = Envelope::<Value>::from_json(&m.payload).unwrap();
        actual
            .entry(env.subject().to_owned())
            .or_default()
            .push(env.id().to_string());
    }
    assert_eq!(actual.len(), SUBJECT_COUNT);
    let violations = expected
        .iter()
        .filter(|(subject, ids)| actual.get(*subject) != Some(ids))
        .count();
    assert_eq!(violations, 0, "subjects published out of created_at order");
}

#[tokio::test]
async fn the_watermark_trap_a_late_commit_with_an_earlier_created_at_is_still_published() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let relay = relay(&db, broker.url(), "WATERMARK", fast_config()).await;

    // A starts first (so gets the earlier created_at = now()) but commits last.
    let mut slow = db.pool.begin().await.unwrap();
    let early = event("orders.created", "order_1", json!({"who": "slow"}));
    Outbox::unvalidated()
        .enqueue(&mut slow, &early)
        .await
        .unwrap();
    let late = event("orders.created", "order_2", json!({"who": "fast"}));
    commit(&db, std::slice::from_ref(&late)).await;

    assert_eq!(relay.drain().await.unwrap().published, 1);
    slow.commit().await.unwrap();
    let (early_created, late_created): (
        chrono::DateTime<chrono::Utc>,
        chrono::DateTime<chrono::Utc>,
    ) = sqlx::query_as(
        "select (select created_at from outbox_events where id = $1),
                    (select created_at from outbox_events where id = $2)",
    )
    .bind(early.id().as_uuid())
    .bind(late.id().as_uuid())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(early_created < late_created, "the trap is set");

    assert_eq!(relay.drain().await.unwrap().published, 1);
    assert_eq!(unpublished(&db).await, 0);
    let ids: Vec<String> = stream_messages(broker.url(), "WATERMARK")
        .await
        .iter()
        .map(msg_id)
        .collect();
    assert_eq!(ids, [late.id().to_string(), early.id().to_string()]);
}

#[tokio::test]
async fn poison_rows_block_only_their_own_subject() {
    let _ = snapshotter();
    let capped_before = counter("outbox_relay_capped_rows_total");
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let config = fast_config()
        .max_attempts(3)
        .backoff_base(Duration::from_millis(20))
        .backoff_max(Duration::from_millis(50));
    let relay = relay(&db, broker.url(), "POISON", config).await;

    // 1. a type that is not a valid subject (written by another client)
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         values ($1, 'orders created', 'php', 'bad_type', now(), '{}')",
    )
    .bind(Uuid::now_v7())
    .execute(&db.pool)
    .await
    .unwrap();
    // 2. a body over the broker's max payload (1 MiB), written by plain SQL
    //    (the library refuses to write it)
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         values ($1, 'orders.created', 'php', 'too_big', now(), jsonb_build_object('blob', repeat('x', 1200000)))",
    )
    .bind(Uuid::now_v7())
    .execute(&db.pool)
    .await
    .unwrap();
    // 3. a subject no stream captures
    let nostream = event("inventory.moved", "no_stream", json!({}));
    commit(&db, &[nostream]).await;
    // Followers of each poisoned subject, and healthy traffic.
    let mut followers = Vec::new();
    for subject in ["bad_type", "too_big", "no_stream"] {
        followers.push(event("orders.created", subject, json!({"after": "poison"})));
    }
    commit(&db, &followers).await;
    let healthy: Vec<_> = (0..50)
        .map(|i| event("billing.paid", &format!("acct_{}", i % 10), json!({"n": i})))
        .collect();
    commit(&db, &healthy).await;

    let shutdown = CancellationToken::new();
    let run = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown.cancelled_owned()).await })
    };
    wait_until(
        "healthy subjects flow, poison rows hit the cap, the uncaptured type waits",
        Duration::from_secs(30),
        || async {
            scalar(
                &db,
                "select count(*) from outbox_events where attempts >= 3",
            )
            .await
                == 2
                && scalar(
                    &db,
                    "select count(*) from outbox_events where last_error like 'not_captured:%'",
                )
                .await
                    == 1
                && unpublished(&db).await == 6
        },
    )
    .await
    .unwrap();
    shutdown.cancel();
    run.await.unwrap().unwrap();

    let errors: Vec<(String, String)> = sqlx::query_as(
        "select subject, last_error from outbox_events where attempts >= 3 order by subject",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(errors[0].0, "bad_type");
    assert!(errors[0].1.contains("invalid"), "{errors:?}");
    assert_eq!(errors[1].0, "too_big");
    assert!(errors[1].1.contains("too_large"), "{errors:?}");
    // A type the stream does not capture is the stream's configuration, not
    // the row's fault: it waits in the retry lane, no attempt counted, until
    // an operator adds the subject (tests/tests/stream_changes.rs).
    let (attempts, error): (i32, String) = sqlx::query_as(
        "select attempts, last_error from outbox_events
          where subject = 'no_stream' and event_type = 'inventory.moved'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(attempts, 0, "{error}");
    assert!(error.contains("not captured by the stream"), "{error}");
    // The followers wait behind their poisoned heads, never published.
    for f in &followers {
        let published: Option<chrono::DateTime<chrono::Utc>> =
            sqlx::query_scalar("select published_at from outbox_events where id = $1")
                .bind(f.id().as_uuid())
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert!(
            published.is_none(),
            "{} overtook its poisoned head",
            f.subject()
        );
    }
    assert_eq!(stream_messages(broker.url(), "POISON").await.len(), 50);
    assert!(counter("outbox_relay_capped_rows_total") >= capped_before + 2);
}

#[tokio::test]
async fn retention_deletes_only_published_rows_older_than_the_window() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let events: Vec<_> = (0..5)
        .map(|i| event("orders.created", &format!("o{i}"), json!({"n": i})))
        .collect();
    commit(&db, &events).await;
    let set = |id: Uuid, sql: &'static str| {
        let pool = db.pool.clone();
        async move { sqlx::query(sql).bind(id).execute(&pool).await.unwrap() }
    };
    let id = |i: usize| *events[i].id().as_uuid();
    set(
        id(0),
        "update outbox_events set published_at = now() - interval '8 days' where id = $1",
    )
    .await;
    set(
        id(1),
        "update outbox_events set published_at = now() - interval '1 hour' where id = $1",
    )
    .await;
    set(id(2), "update outbox_events set created_at = now() - interval '30 days', attempts = 50 where id = $1").await;
    // events[3]: unpublished and fresh.
    // events[4]: skipped by an operator while a relay published it (both
    // set), long ago: kept, as every skipped row is.
    set(
        id(4),
        "update outbox_events set published_at = now() - interval '8 days', \
         skipped_at = now() - interval '8 days', skipped_by = 'op', skip_reason = 'poison' \
         where id = $1",
    )
    .await;

    let relay = relay(
        &db,
        broker.url(),
        "RETENTION",
        fast_config().retention(Some(Duration::from_secs(7 * 24 * 3600))),
    )
    .await;
    assert_eq!(relay.prune().await.unwrap(), 1);
    let left: Vec<Uuid> = sqlx::query_scalar("select id from outbox_events order by id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(left, [id(1), id(2), id(3), id(4)]);
}

#[tokio::test]
async fn a_commit_wakes_the_relay_without_waiting_for_the_poll() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let relay = relay(
        &db,
        broker.url(),
        "WAKE",
        fast_config().poll_interval(Duration::from_secs(30)),
    )
    .await;
    let shutdown = CancellationToken::new();
    let run = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown.cancelled_owned()).await })
    };
    // Let the first (empty) poll pass and the listener attach.
    wait_until("relay listening", Duration::from_secs(10), || async {
        scalar(
            &db,
            "select count(*) from pg_stat_activity where query ilike 'listen%'",
        )
        .await
            > 0
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let started = std::time::Instant::now();
    commit(&db, &[event("orders.created", "o1", json!({}))]).await;
    wait_until("published after NOTIFY", Duration::from_secs(5), || async {
        unpublished(&db).await == 0
    })
    .await
    .unwrap();
    let latency = started.elapsed();
    assert!(
        latency < Duration::from_secs(5),
        "took {latency:?} with a 30 s poll"
    );
    shutdown.cancel();
    run.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_stream_that_differs_from_the_config_is_a_startup_error() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let js = jetstream::new(connect(broker.url()).await);
    js.create_stream(jetstream::stream::Config {
        name: "MISMATCH".into(),
        subjects: vec!["orders.>".into()],
        storage: StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();
    let spec = stream_spec("MISMATCH").storage(StorageType::File);
    let err = Relay::jetstream(
        db.pool.clone(),
        connect(broker.url()).await,
        &spec,
        fast_config(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Stream);
    let msg = err.to_string();
    assert!(
        msg.contains("billing.>") && msg.contains("storage"),
        "{msg}"
    );

    let missing = StreamSpec::new("NOPE", vec![]);
    let err = Relay::jetstream(
        db.pool.clone(),
        connect(broker.url()).await,
        &missing,
        fast_config(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Stream);
    assert!(err.to_string().contains("does not exist"), "{err}");
}

/// A republish after a takeover must fall inside the stream's duplicate
/// window, or the broker stores it twice: a window no longer than lease +
/// publish timeout is refused at start-up, naming both.
#[tokio::test]
async fn a_duplicate_window_shorter_than_lease_plus_publish_timeout_is_a_startup_error() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let js = jetstream::new(connect(broker.url()).await);
    js.create_stream(jetstream::stream::Config {
        name: "SHORTWINDOW".into(),
        subjects: SUBJECTS.iter().map(|s| s.to_string()).collect(),
        duplicate_window: Duration::from_secs(10),
        ..Default::default()
    })
    .await
    .unwrap();
    let config = fast_config()
        .lease(Duration::from_secs(30))
        .publish_timeout(Duration::from_secs(5));
    let err = Relay::jetstream(
        db.pool.clone(),
        connect(broker.url()).await,
        &stream_spec("SHORTWINDOW"),
        config,
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    let msg = err.to_string();
    assert!(
        msg.contains("duplicate window of 10s") && msg.contains("35s"),
        "{msg}"
    );
    // A lease that fits is accepted on the same stream.
    let config = fast_config()
        .lease(Duration::from_secs(4))
        .publish_timeout(Duration::from_secs(1));
    Relay::jetstream(
        db.pool.clone(),
        connect(broker.url()).await,
        &stream_spec("SHORTWINDOW"),
        config,
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn shutdown_finishes_promptly() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let relay = relay(&db, broker.url(), "SHUTDOWN", RelayConfig::default()).await;
    let shutdown = CancellationToken::new();
    let run = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown.cancelled_owned()).await })
    };
    commit(&db, &[event("orders.created", "o1", json!({}))]).await;
    wait_until("published", Duration::from_secs(10), || async {
        unpublished(&db).await == 0
    })
    .await
    .unwrap();
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("relay stops within 5 s of shutdown")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_blocked_subject_with_a_long_queue_does_not_starve_the_others() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    // The oldest 40 rows all belong to one subject whose head cannot be
    // published; the batch is smaller than that queue.
    let mut blocked = vec![event("inventory.moved", "hot", json!({"head": true}))];
    blocked.extend((0..39).map(|i| event("orders.created", "hot", json!({"n": i}))));
    commit(&db, &blocked).await;
    let healthy: Vec<_> = (0..30)
        .map(|i| event("billing.paid", &format!("acct_{i}"), json!({"n": i})))
        .collect();
    commit(&db, &healthy).await;

    let config = fast_config()
        .batch_size(10)
        .backoff_base(Duration::from_secs(5))
        .backoff_max(Duration::from_secs(5));
    let relay = relay(&db, broker.url(), "STARVE", config).await;
    let shutdown = CancellationToken::new();
    let run = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown.cancelled_owned()).await })
    };
    wait_until(
        "the healthy subjects drain",
        Duration::from_secs(20),
        || async { unpublished(&db).await == 40 },
    )
    .await
    .unwrap();
    shutdown.cancel();
    run.await.unwrap().unwrap();
    assert_eq!(
        scalar(
            &db,
            "select count(*) from outbox_events where subject = 'hot' and published_at is not null"
        )
        .await,
        0
    );
    // The queue behind the failed head was deferred, not retried: only the
    // head was tried (refused as not captured, which costs no attempt).
    assert_eq!(
        scalar(
            &db,
            "select count(*) from outbox_events where subject = 'hot' and last_error is not null"
        )
        .await,
        1
    );
}

/// The watermark trap against the per-shard cursors: a transaction takes its
/// seq, stays open while thousands of later rows on every shard are published
/// (moving the cursors on), then commits. Its event must be read at once, not
/// at the next full sweep of its shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seq_taken_before_thousands_of_published_rows_and_committed_after_them_is_published_at_once()
 {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let relay = relay(&db, broker.url(), "LATE", fast_config()).await;
    let shutdown = CancellationToken::new();
    let run = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown.cancelled_owned()).await })
    };

    let mut slow = db.pool.begin().await.unwrap();
    let late = event("orders.created", "late", json!({"who": "slow"}));
    Outbox::unvalidated()
        .enqueue(&mut slow, &late)
        .await
        .unwrap();
    // Later seqs on every shard, committed and published while `slow` is open.
    for round in 0..10 {
        let events: Vec<_> = (0..200)
            .map(|i| event("orders.created", &format!("s{i}"), json!({"round": round})))
            .collect();
        commit(&db, &events).await;
    }
    wait_until(
        "the 2,000 later rows published",
        Duration::from_secs(60),
        || async {
            scalar(
                &db,
                "select count(*) from outbox_events where published_at is not null",
            )
            .await
                == 2_000
        },
    )
    .await
    .unwrap();
    // More batches on every shard after that, so any cursor that could move
    // past the open transaction's seq has done so.
    commit(
        &db,
        &(0..200)
            .map(|i| event("orders.created", &format!("s{i}"), json!({"round": 10})))
            .collect::<Vec<_>>(),
    )
    .await;
    wait_until(
        "the next 200 published",
        Duration::from_secs(30),
        || async {
            scalar(
                &db,
                "select count(*) from outbox_events where published_at is not null",
            )
            .await
                == 2_200
        },
    )
    .await
    .unwrap();
    let (late_seq, max_seq): (i64, i64) = sqlx::query_as(
        "select (select min(seq) from outbox_events where published_at is not null) - 1,
                (select max(seq) from outbox_events)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        late_seq < max_seq,
        "the open transaction holds the lowest seq"
    );

    slow.commit().await.unwrap();
    // Well inside the 60 s sweep: only a cursor that waited for the open
    // transaction finds it this fast.
    wait_until(
        "the late commit published",
        Duration::from_secs(10),
        || async { unpublished(&db).await == 0 },
    )
    .await
    .unwrap();
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let ids: HashSet<String> = stream_messages(broker.url(), "LATE")
        .await
        .iter()
        .map(msg_id)
        .collect();
    assert!(ids.contains(&late.id().to_string()));
    assert_eq!(ids.len(), 2_201);
}

/// An operator repairs a parked row and makes it due: it is published, then
/// the rows deferred behind it, in order, without waiting out their deferral.
#[tokio::test]
async fn a_repaired_parked_row_is_published_first_and_its_followers_after_it_in_order() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let config = fast_config()
        .max_attempts(3)
        .backoff_base(Duration::from_millis(20))
        .backoff_max(Duration::from_secs(60));
    let relay = relay(&db, broker.url(), "REPAIR", config).await;
    let bad = Uuid::now_v7();
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data, traceparent)
         values ($1, 'orders.created', 'php', 'fixme', now(), '{\"n\": 0}', 'not a traceparent')",
    )
    .bind(bad)
    .execute(&db.pool)
    .await
    .unwrap();
    let followers: Vec<_> = (1..=3)
        .map(|n| event("orders.created", "fixme", json!({"n": n})))
        .collect();
    commit(&db, &followers).await;
    commit(&db, &[event("orders.created", "other", json!({}))]).await;

    let shutdown = CancellationToken::new();
    let run = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move { relay.run(shutdown.cancelled_owned()).await })
    };
    wait_until(
        "the bad row parked, its followers deferred, the rest published",
        Duration::from_secs(20),
        || async {
            scalar(
                &db,
                "select count(*) from outbox_events
                  where subject = 'fixme' and attempts >= 3 and next_attempt_at = 'infinity'
                    and last_error like '%traceparent%'",
            )
            .await
                == 1
                && scalar(
                    &db,
                    "select count(*) from outbox_events
                      where subject = 'fixme' and attempts = 0 and next_attempt_at > now()",
                )
                .await
                    == 3
                && unpublished(&db).await == 4
        },
    )
    .await
    .unwrap();

    // The documented repair: fix the row, reset its attempts, make it due.
    sqlx::query(
        "update outbox_events
            set traceparent = null, attempts = 0, next_attempt_at = now(), last_error = null
          where id = $1",
    )
    .bind(bad)
    .execute(&db.pool)
    .await
    .unwrap();
    // The followers were deferred for the 60 s cap; waking them is what makes
    // this fast.
    wait_until("all published", Duration::from_secs(10), || async {
        unpublished(&db).await == 0
    })
    .await
    .unwrap();
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let order: Vec<i64> = stream_messages(broker.url(), "REPAIR")
        .await
        .iter()
        .map(|m| Envelope::<Value>::from_json(&m.payload).unwrap())
        .filter(|e| e.subject() == "fixme")
        .map(|e| e.data()["n"].as_i64().unwrap())
        .collect();
    assert_eq!(order, [0, 1, 2, 3]);
}

/// Large payloads: a batch holds at most its byte budget (plus one row), and
/// rows past it are read again next batch without their data, so a backlog of
/// large rows cannot exhaust the relay's memory and still drains, in order.
#[tokio::test]
async fn a_batch_is_bounded_in_bytes_and_large_rows_still_drain_in_order() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    // 40 rows of ~400 KB (16 MB) on 2 subjects, written by plain SQL.
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         select gen_random_uuid(), 'orders.created', 'php', 'big-' || (g % 2), now(),
                jsonb_build_object('n', g, 'blob', repeat('x', 400000))
           from generate_series(1, 40) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let relay = relay(
        &db,
        broker.url(),
        "BYTES",
        fast_config().batch_bytes(1024 * 1024),
    )
    .await;
    let report = relay.drain().await.unwrap();
    assert_eq!(report.published, 40);
    // Every batch read more rows than its budget let it carry: those came
    // without data and were read again.
    assert!(report.unresolved >= 20, "{report:?}");
    assert_eq!(unpublished(&db).await, 0);
    let mut last: HashMap<String, i64> = HashMap::new();
    for m in stream_messages(broker.url(), "BYTES").await {
        let e = Envelope::<Value>::from_json(&m.payload).unwrap();
        let n = e.data()["n"].as_i64().unwrap();
        let prev = last.insert(e.subject().to_owned(), n).unwrap_or(0);
        assert!(n > prev, "{} out of order: {prev} then {n}", e.subject());
    }
}

/// The plan of the relay's mark statement (`queries/mark_published.sql`) for
/// `n` of the unpublished rows, made for those parameters as the relay's
/// unprepared statement is (`plan_cache_mode = force_custom_plan`).
async fn mark_plan(db: &TestDb, n: usize) -> String {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(db.url()).await.unwrap();
    let ids: Vec<String> = sqlx::query_scalar(
        "select id::text from outbox_events where published_at is null order by seq limit $1",
    )
    .bind(i64::try_from(n).unwrap())
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let mark = include_str!("../../../outbox-publisher/queries/mark_published.sql");
    let prepare = format!("prepare mark(uuid[], text[], bigint[]) as {mark}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(prepare))
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::raw_sql("set plan_cache_mode = force_custom_plan")
        .execute(&mut conn)
        .await
        .unwrap();
    let streams = vec!["S"; ids.len()].join(",");
    let seqs: Vec<String> = (1..=ids.len()).map(|i| i.to_string()).collect();
    let explain = format!(
        "explain (format json) execute mark('{{{}}}', '{{{streams}}}', '{{{}}}')",
        ids.join(","),
        seqs.join(",")
    );
    let plan: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(explain))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    plan.to_string()
}

/// After a burst of writes the statistics have not seen (they were taken
/// when every row was published), a mark still finds its rows through the
/// primary key, one lookup per id: not by reading every unpublished row
/// through the unpublished index (a cost that grows with the backlog a relay
/// catches up on), nor by hashing the ids against a scan of the table.
#[tokio::test]
async fn a_mark_finds_its_rows_by_id_whatever_the_statistics_say() {
    let db = TestDb::new().await.unwrap();
    let insert = |n: i64| {
        sqlx::query(
            "insert into outbox_events (id, event_type, source, subject, time, data)
             select gen_random_uuid(), 'plan.checked', 'test', 'e-' || (g % 100), now(), '{}'
               from generate_series(1, $1) g",
        )
        .bind(n)
    };
    insert(2_000).execute(&db.pool).await.unwrap();
    sqlx::query("update outbox_events set published_at = now()")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("analyze outbox_events")
        .execute(&db.pool)
        .await
        .unwrap();
    insert(60_000).execute(&db.pool).await.unwrap();
    // The relay runs the mark unprepared: a plan for its parameters.
    for n in [100, 1_000, 5_000] {
        let plan = mark_plan(&db, n).await;
        assert!(
            !plan.contains("outbox_events_unpublished_idx")
                && !plan.contains("Materialize")
                && !plan.contains("Seq Scan")
                && !plan.contains("Hash Join"),
            "{n} rows: {plan}"
        );
        assert!(plan.contains("outbox_events_pkey"), "{n} rows: {plan}");
    }
}
