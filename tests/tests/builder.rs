//! Typed events and the one-call consumer, against real PostgreSQL and
//! nats-server: an event type declared once (type string, payload, derived
//! schema) is written with `Outbox::enqueue`, relayed, and consumed by
//! `Consumer::builder`, which subscribes to the router's types only and waits
//! for a stream that a relay creates after it started.

mod support;

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use inbox_consumer::InTx;
use inbox_consumer::prelude::*;
use outbox_pg::SchemaRegistry;
use outbox_publisher::{Relay, RelayConfig, StreamSpec};
use outbox_testkit::{TestDb, wait_until};
use serde::{Deserialize, Serialize};
use sqlx::PgTransaction;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

/// An account was opened.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct AccountOpened {
    #[schemars(length(min = 1))]
    account_id: String,
    #[schemars(range(min = 0))]
    credit_cents: i64,
}

impl Event for AccountOpened {
    const TYPE: &'static str = "acct.opened";
}

/// An account was closed.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
struct AccountClosed {
    account_id: String,
}

impl Event for AccountClosed {
    const TYPE: &'static str = "acct.closed";
}

#[derive(Clone)]
struct Open;

impl Handler for Open {
    type Message = AccountOpened;

    async fn handle(
        &self,
        event: Envelope<AccountOpened>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        sqlx::query("insert into accounts (id, credit_cents) values ($1, $2)")
            .bind(&event.data().account_id)
            .bind(event.data().credit_cents)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// [`Open`] a group at a time, noting the largest group.
#[derive(Clone, Default)]
struct OpenAll {
    largest: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl BatchHandler for OpenAll {
    type Message = AccountOpened;

    async fn handle_batch(
        &self,
        events: Vec<Envelope<AccountOpened>>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        self.largest
            .fetch_max(events.len(), std::sync::atomic::Ordering::SeqCst);
        let (ids, credits): (Vec<String>, Vec<i64>) = events
            .iter()
            .map(|e| (e.data().account_id.clone(), e.data().credit_cents))
            .unzip();
        sqlx::query(
            "insert into accounts (id, credit_cents) select * from unnest($1::text[], $2::int8[])",
        )
        .bind(&ids)
        .bind(&credits)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

async fn database() -> TestDb {
    let db = TestDb::new().await.unwrap();
    outbox_pg::migrate_with(
        &db.pool,
        "create table accounts (id text primary key, credit_cents bigint not null)",
    )
    .await
    .unwrap();
    db
}

#[tokio::test]
async fn typed_events_flow_from_enqueue_to_a_builder_started_before_its_stream() {
    let db = database().await;
    let nats = outbox_testkit::nats().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let stream = "BUILDER_TYPED";

    // The consumer starts first: its stream does not exist yet.
    let stop = CancellationToken::new();
    let consumer = tokio::spawn(
        Consumer::builder(db.pool.clone(), client.clone(), stream, "accounts")
            .handler(Open)
            .configure(|c| c.concurrency(4))
            .run(stop.clone().cancelled_owned()),
    );
    wait_until("the builder to look for its stream", WAIT, || async {
        js.get_stream(stream).await.is_err() && !consumer.is_finished()
    })
    .await
    .unwrap();

    // The schema registry, the envelope and the router all take the type from
    // the event; a payload outside the derived schema is refused at enqueue.
    let outbox = Outbox::new(
        SchemaRegistry::new()
            .with_event::<AccountOpened>()
            .unwrap()
            .with_event::<AccountClosed>()
            .unwrap(),
    );
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..5 {
        let data = AccountOpened {
            account_id: format!("a{i}"),
            credit_cents: 100 * i,
        };
        let event = Envelope::event("accounts", format!("a{i}"), data).unwrap();
        outbox.enqueue(&mut tx, &event).await.unwrap();
    }
    // Another type on the same stream, which no route handles.
    let closed = Envelope::event(
        "accounts",
        "a0",
        AccountClosed {
            account_id: "a0".into(),
        },
    )
    .unwrap();
    outbox.enqueue(&mut tx, &closed).await.unwrap();
    tx.commit().await.unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let bad = Envelope::event(
        "accounts",
        "a9",
        AccountOpened {
            account_id: String::new(),
            credit_cents: -1,
        },
    )
    .unwrap();
    let err = outbox.enqueue(&mut tx, &bad).await.unwrap_err();
    assert_eq!(err.kind(), outbox_pg::ErrorKind::SchemaViolation, "{err}");
    let text = err.to_string();
    assert!(
        text.contains("/account_id") && text.contains("/credit_cents"),
        "{text}"
    );
    drop(tx);

    // The relay arrives, and creates the stream.
    let relay = tokio::spawn(Relay::run_jetstream(
        db.pool.clone(),
        client.clone(),
        StreamSpec::new(stream, vec!["acct.>".into()]),
        RelayConfig::default(),
        stop.clone().cancelled_owned(),
    ));
    wait_until("five accounts opened", WAIT, || async {
        support::count(&db.pool, "select count(*) from accounts").await == 5
    })
    .await
    .unwrap();

    // A copy of one event, published again under another message id (as a
    // second relay or a replay would): the inbox makes it a duplicate.
    let first: (uuid::Uuid, serde_json::Value) = sqlx::query_as(
        "select id, data from outbox_events where event_type = 'acct.opened' order by seq limit 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let copy = outbox_pg::Envelope::new("acct.opened", "accounts", "a0", first.1)
        .unwrap()
        .with_id(outbox_pg::EventId::from_uuid(first.0));
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "a-copy");
    js.publish_with_headers("acct.opened", headers, copy.to_json().unwrap().into())
        .await
        .unwrap()
        .await
        .unwrap();

    // The durable subscribes to the routed type only: the copy is consumed,
    // the closed event never reaches it.
    let mut durable: jetstream::consumer::PullConsumer = js
        .get_stream(stream)
        .await
        .unwrap()
        .get_consumer("accounts")
        .await
        .unwrap();
    let info = durable.info().await.unwrap().clone();
    // One subject travels as `filter_subject`, several as `filter_subjects`.
    let mut filters = info.config.filter_subjects.clone();
    filters.extend(
        (!info.config.filter_subject.is_empty()).then(|| info.config.filter_subject.clone()),
    );
    assert_eq!(filters, ["acct.opened"]);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let info = durable.info().await.unwrap();
        if info.num_pending == 0 && info.num_ack_pending == 0 && info.delivered.stream_sequence >= 7
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the copy is not consumed: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        support::count(&db.pool, "select count(*) from accounts").await,
        5
    );
    assert_eq!(
        support::count(&db.pool, "select count(*) from inbox_events").await,
        5
    );
    assert_eq!(
        support::count(&db.pool, "select count(*) from inbox_dead_letters").await,
        0
    );
    let stream_info = js
        .get_stream(stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(stream_info.state.messages, 7, "5 opened, 1 closed, 1 copy");

    stop.cancel();
    consumer.await.unwrap().unwrap();
    relay.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_builder_without_a_handler_or_a_stream_fails_clearly() {
    let db = database().await;
    let nats = outbox_testkit::nats().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();

    let err = Consumer::builder(db.pool.clone(), client.clone(), "BUILDER_NONE", "empty")
        .run(std::future::pending())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("no handler"), "{err}");

    let started = tokio::time::Instant::now();
    let err = Consumer::builder(db.pool.clone(), client.clone(), "BUILDER_NEVER", "waits")
        .handler(Open)
        .stream_patience(Duration::from_millis(600))
        .run(std::future::pending())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::StreamUnavailable, "{err}");
    assert!(err.to_string().contains("BUILDER_NEVER"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));

    // Without patience it waits until shutdown, and shutdown is not an error.
    let stop = CancellationToken::new();
    let waiting = tokio::spawn(
        Consumer::builder(db.pool.clone(), client, "BUILDER_NEVER", "waits")
            .handler(Open)
            .run(stop.clone().cancelled_owned()),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished());
    stop.cancel();
    tokio::time::timeout(WAIT, waiting)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_batched_builder_handles_each_event_once_through_duplicates() {
    batched_builder("BUILDER_BATCHED", None, |b| b).await;
}

/// The same through a [`BatchHandler`]: groups of more than one event.
#[tokio::test]
async fn a_batched_builder_hands_a_batch_handler_groups_each_event_once() {
    let handler = OpenAll::default();
    batched_builder("BUILDER_GROUPED", Some(handler.clone()), |b| b).await;
    let largest = handler.largest.load(std::sync::atomic::Ordering::SeqCst);
    assert!(largest > 1, "largest group {largest}");
}

/// A layer added through the builder wraps the batch handler's group call
/// with `batch_layer`, so groups stay groups; with `layer` (one delivery at a
/// time) the handler gets groups of one. Every account is opened once either way,
/// and the layer saw every call.
#[tokio::test]
async fn layers_added_through_the_builder_wrap_each_call_and_batch_layer_keeps_groups() {
    let handler = OpenAll::default();
    let calls = Calls::default();
    let layer = calls.clone();
    batched_builder("BUILDER_LAYERED_GROUPS", Some(handler.clone()), move |b| {
        b.batch_layer(tower::limit::ConcurrencyLimitLayer::new(1))
            .batch_layer(layer)
    })
    .await;
    let largest = handler.largest.load(std::sync::atomic::Ordering::SeqCst);
    assert!(largest > 1, "largest group {largest}");
    assert!(calls.groups() > 0, "the layer never saw a group");

    let handler = OpenAll::default();
    let calls = Calls::default();
    let layer = calls.clone();
    batched_builder("BUILDER_LAYERED_EACH", Some(handler.clone()), move |b| {
        b.layer(layer)
    })
    .await;
    let largest = handler.largest.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(largest, 1, "a per-delivery layer was passed by a group");
    assert_eq!(calls.deliveries(), 50, "one call per fresh delivery");
    assert_eq!(calls.groups(), 0);
}

/// A tower `TimeoutLayer` through the builder: a handler slower than it
/// fails its delivery, whose transaction rolls back (its insert with it), and
/// the retry opens the account once.
#[tokio::test]
async fn a_timeout_layer_through_the_builder_fails_a_slow_handler_and_the_retry_applies_it_once() {
    let db = database().await;
    let nats = outbox_testkit::nats().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let stream = "BUILDER_TIMEOUT";
    js.create_stream(jetstream::stream::Config {
        name: stream.into(),
        subjects: vec!["acct.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    for i in 0..5 {
        let data = AccountOpened {
            account_id: format!("t{i}"),
            credit_cents: i,
        };
        let event = Envelope::event("accounts", format!("t{i}"), data).unwrap();
        js.publish("acct.opened", event.to_json().unwrap().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let handler = SlowOnce::default();
    let stop = CancellationToken::new();
    let consumer = tokio::spawn(
        Consumer::builder(db.pool.clone(), js.clone(), stream, "timed")
            .handler(handler.clone())
            .layer(tower::timeout::TimeoutLayer::new(Duration::from_millis(
                300,
            )))
            .configure(|c| {
                c.retry(inbox_consumer::RetryPolicy::default().base(Duration::from_millis(50)))
            })
            .run(stop.clone().cancelled_owned()),
    );
    wait_until("five accounts opened", WAIT, || async {
        support::count(&db.pool, "select count(*) from accounts").await == 5
            && support::count(&db.pool, "select count(*) from inbox_events").await == 5
    })
    .await
    .unwrap();
    assert_eq!(
        handler.calls.load(std::sync::atomic::Ordering::SeqCst),
        6,
        "five events, one of them twice (timed out, retried)"
    );
    assert_eq!(
        support::count(&db.pool, "select count(*) from inbox_dead_letters").await,
        0
    );
    stop.cancel();
    consumer.await.unwrap().unwrap();
}

/// [`Open`], but the first call inserts and then outlasts any timeout.
#[derive(Clone, Default)]
struct SlowOnce {
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Handler for SlowOnce {
    type Message = AccountOpened;

    async fn handle(
        &self,
        event: Envelope<AccountOpened>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        let first = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        Open.handle(event, tx).await?;
        if first {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        Ok(())
    }
}

/// A layer counting the calls it wraps: deliveries and groups.
#[derive(Clone, Default)]
struct Calls {
    deliveries: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    groups: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Calls {
    fn deliveries(&self) -> usize {
        self.deliveries.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn groups(&self) -> usize {
        self.groups.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl<S> tower::Layer<S> for Calls {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            calls: self.clone(),
        }
    }
}

/// A service [`Calls`] counts.
#[derive(Clone)]
struct Counted<S> {
    inner: S,
    calls: Calls,
}

impl<S> tower::Service<InTx<Delivery>> for Counted<S>
where
    S: tower::Service<InTx<Delivery>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: InTx<Delivery>) -> S::Future {
        self.calls
            .deliveries
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.call(request)
    }
}

impl<S> tower::Service<InTx<Vec<Delivery>>> for Counted<S>
where
    S: tower::Service<InTx<Vec<Delivery>>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: InTx<Vec<Delivery>>) -> S::Future {
        self.calls
            .groups
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.call(request)
    }
}

/// 50 events and 10 copies consumed by a batched builder, with [`Open`] or
/// with `grouped`, after `configure`: every account opened once.
async fn batched_builder(
    stream: &str,
    grouped: Option<OpenAll>,
    configure: impl FnOnce(ConsumerBuilder) -> ConsumerBuilder,
) {
    let db = database().await;
    let nats = outbox_testkit::nats().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    js.create_stream(jetstream::stream::Config {
        name: stream.into(),
        subjects: vec!["acct.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();

    // 50 events, then 10 of them again under other message ids.
    let events: Vec<Envelope<AccountOpened>> = (0..50)
        .map(|i| {
            let data = AccountOpened {
                account_id: format!("b{i}"),
                credit_cents: i,
            };
            Envelope::event("accounts", format!("b{i}"), data).unwrap()
        })
        .collect();
    for (n, event) in events.iter().chain(&events[..10]).enumerate() {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("m{n}").as_str());
        js.publish_with_headers("acct.opened", headers, event.to_json().unwrap().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    let stop = CancellationToken::new();
    let builder = Consumer::builder(db.pool.clone(), js.clone(), stream, "batched");
    let builder = match grouped {
        Some(handler) => builder.batch_handler(handler),
        None => builder.handler(Open),
    };
    let consumer = tokio::spawn(
        configure(builder)
            .batched(16)
            .run(stop.clone().cancelled_owned()),
    );
    let mut durable: jetstream::consumer::PullConsumer = loop {
        if let Ok(c) = js
            .get_stream(stream)
            .await
            .unwrap()
            .get_consumer("batched")
            .await
        {
            break c;
        }
        assert!(!consumer.is_finished(), "the consumer ended early");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let info = durable.info().await.unwrap();
        if info.num_pending == 0
            && info.num_ack_pending == 0
            && info.delivered.stream_sequence >= 60
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not all consumed: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        support::count(&db.pool, "select count(*) from accounts").await,
        50
    );
    assert_eq!(
        support::count(&db.pool, "select count(*) from inbox_events").await,
        50
    );
    assert_eq!(
        support::count(&db.pool, "select count(*) from inbox_dead_letters").await,
        0
    );
    stop.cancel();
    consumer.await.unwrap().unwrap();
}

/// A consumer on a database where the migrations never ran refuses at start,
/// naming the missing table and what to run, instead of retrying every
/// message for ever on `relation "inbox_events" does not exist`.
#[tokio::test]
async fn a_consumer_on_an_unmigrated_database_refuses_at_start_saying_what_to_run() {
    let migrated = TestDb::new().await.unwrap();
    let name = format!("unmigrated_{}", uuid::Uuid::now_v7().simple());
    let url = outbox_testkit::create_database(migrated.url(), &name)
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let stream = "BUILDER_UNMIGRATED";
    jetstream::new(client.clone())
        .create_stream(jetstream::stream::Config {
            name: stream.into(),
            subjects: vec!["account.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let run = Consumer::builder(pool.clone(), client, stream, "accounts")
        .handler(Open)
        .run(std::future::pending::<()>());
    // It waits out SCHEMA_WAIT for a service migrating beside it, then stops.
    let result = tokio::time::timeout(outbox_pg::SCHEMA_WAIT + WAIT, run)
        .await
        .expect("the consumer kept running on a database without the inbox");
    let e = result.expect_err("a consumer without its tables ran");
    let text = outbox_pg::error_line(&e);
    assert_eq!(e.kind(), inbox_consumer::ErrorKind::Config, "{text}");
    for words in ["inbox_events", "outbox_pg::migrate"] {
        assert!(text.contains(words), "{words:?} not in: {text}");
    }
    let tables: i64 =
        sqlx::query_scalar("select count(*) from pg_tables where schemaname = 'public'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(tables, 0, "the consumer created tables of its own");
}
