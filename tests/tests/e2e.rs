//! End to end: the `subscriptions` HTTP service and the `billing` consumer,
//! used as libraries in-process, against real PostgreSQL (one database per
//! service) and a real nats-server, with every duplicate the outbox can
//! produce: a consumer dying between commit and ack, a relay dying between
//! publish and mark, a republish past the stream's duplicate window, a broker
//! killed mid-traffic, and events arriving out of order.
//!
//! Written as a service author would test their own services, so it doubles
//! as a template: build the app and the consumer stack from the service crates,
//! drive the app with `tower::ServiceExt::oneshot`, run the relays and the
//! consumer as tasks, and wait for outcomes with bounded deadlines.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use example_billing::{CrashAfterCommitLayer, Stack, StackOptions};
use example_subscriptions::AppState;
use futures::StreamExt;
use inbox_consumer::{BoxError, Delivery, Outcome, RetryPolicy};
use outbox_pg::{Outbox, SchemaRegistry};
use outbox_publisher::{Relay, RelayConfig, StreamSpec};
use outbox_testkit::{NatsServer, TestDb, wait_until};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower::{Service, ServiceExt};

const WAIT: Duration = Duration::from_secs(30);
const STREAM: &str = "OUTBOX";
const DURABLE: &str = "billing";

// ---------------------------------------------------------------------------
// The world: two services' databases and one broker.

struct World {
    /// The subscriptions service's database.
    subs: TestDb,
    /// Billing's database.
    billing: TestDb,
    nats: NatsServer,
    client: async_nats::Client,
    js: jetstream::Context,
    outbox: Outbox,
}

async fn world() -> World {
    let subs = TestDb::new().await.unwrap();
    let billing = TestDb::new().await.unwrap();
    example_subscriptions::migrate(&subs.pool).await.unwrap();
    example_billing::migrate(&billing.pool).await.unwrap();
    let nats = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let schemas = SchemaRegistry::from_dir(example_subscriptions::default_schemas_dir()).unwrap();
    World {
        subs,
        billing,
        nats,
        client,
        js,
        outbox: Outbox::new(schemas),
    }
}

fn stream_spec() -> StreamSpec {
    StreamSpec::new(STREAM, vec!["subscription.>".into(), "invoice.>".into()])
}

/// A relay that retries fast, so a broker outage costs the test little time.
fn relay_config() -> RelayConfig {
    RelayConfig::default()
        .poll_interval(Duration::from_millis(100))
        .backoff_base(Duration::from_millis(100))
        .backoff_max(Duration::from_millis(500))
        .publish_timeout(Duration::from_secs(2))
}

impl World {
    fn app(&self, fault_injection: bool) -> axum::Router {
        example_subscriptions::router(
            AppState::new(self.subs.pool.clone(), self.outbox.clone())
                .fault_injection(fault_injection),
        )
    }

    /// A relay on `pool`'s outbox, running until stopped.
    async fn relay(&self, pool: &PgPool) -> Task {
        let relay = Relay::jetstream(
            pool.clone(),
            self.client.clone(),
            &stream_spec(),
            relay_config(),
        )
        .await
        .unwrap();
        let stop = CancellationToken::new();
        let token = stop.clone();
        let handle = tokio::spawn(async move {
            relay.run(token.cancelled_owned()).await.unwrap();
        });
        Task { stop, handle }
    }

    /// Billing's consumer with `options`, watched by `seen`, running until stopped.
    /// Billing in-process, ordered as it runs by default.
    async fn billing(&self, options: StackOptions, seen: &Seen) -> Task {
        self.billing_with(options, seen, true).await
    }

    async fn billing_with(&self, options: StackOptions, seen: &Seen, ordered: bool) -> Task {
        let config = example_billing::consumer_config(STREAM, DURABLE)
            .ordered(ordered)
            .ack_wait(Duration::from_secs(1))
            .max_deliver(50)
            .retry(
                RetryPolicy::default()
                    .base(Duration::from_millis(100))
                    .max(Duration::from_secs(1)),
            );
        let consumer = example_billing::connect_consumer(
            self.js.clone(),
            self.billing.pool.clone(),
            config,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        let stack = Observe {
            inner: example_billing::service(
                self.billing.pool.clone(),
                self.outbox.clone(),
                options,
            ),
            seen: seen.clone(),
        };
        let stop = CancellationToken::new();
        let token = stop.clone();
        let handle = tokio::spawn(async move {
            consumer.run(stack, token.cancelled_owned()).await.unwrap();
        });
        Task { stop, handle }
    }

    async fn invoices(&self) -> i64 {
        support::count(&self.billing.pool, "select count(*) from invoices").await
    }

    async fn wait_invoices(&self, n: i64) {
        wait_until(&format!("{n} invoice(s)"), WAIT, || async {
            self.invoices().await >= n
        })
        .await
        .unwrap();
    }

    /// Waits until every message of the billing durable is acked or terminated.
    async fn wait_settled(&self) {
        wait_until("billing's messages all acked", WAIT, || async {
            let Ok(stream) = self.js.get_stream(STREAM).await else {
                return false;
            };
            let Ok(info) = stream.consumer_info(DURABLE).await else {
                return false;
            };
            info.num_pending == 0 && info.num_ack_pending == 0
        })
        .await
        .unwrap();
    }

    /// Waits until `pool`'s outbox has no unpublished row.
    async fn wait_relayed(pool: &PgPool) {
        wait_until("the outbox relayed", WAIT, || async {
            support::count(
                pool,
                "select count(*) from outbox_events where published_at is null",
            )
            .await
                == 0
        })
        .await
        .unwrap();
    }

    /// Messages stored in the stream on `subject`.
    async fn stored(&self, subject: &str) -> usize {
        let stream = self.js.get_stream(STREAM).await.unwrap();
        let mut subjects = stream.info_with_subjects(subject).await.unwrap();
        let mut n = 0;
        while let Some(entry) = subjects.next().await {
            n += entry.unwrap().1;
        }
        n
    }

    /// Publishes bytes as a relay would, with a chosen `Nats-Msg-Id`;
    /// returns whether the stream dropped it as a duplicate.
    async fn publish_raw(&self, subject: &str, payload: Vec<u8>, msg_id: &str) -> bool {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg_id);
        self.js
            .publish_with_headers(subject.to_owned(), headers, payload.into())
            .await
            .unwrap()
            .await
            .unwrap()
            .duplicate
    }

    /// The invoice count per subscription id.
    async fn invoices_by_subscription(&self) -> BTreeMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>(
            "select subscription_id, count(*) from invoices group by subscription_id",
        )
        .fetch_all(&self.billing.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
    }
}

/// A relay or consumer task.
struct Task {
    stop: CancellationToken,
    handle: JoinHandle<()>,
}

impl Task {
    /// Graceful stop: finish what is in hand, then return.
    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.handle)
            .await
            .expect("stops in time")
            .unwrap();
    }

    /// The process dies: everything in flight is dropped, nothing is acked.
    async fn kill(self) {
        self.handle.abort();
        let _ = self.handle.await;
    }
}

// ---------------------------------------------------------------------------
// HTTP through the router, in-process.

async fn call(app: &axum::Router, request: Request<Body>) -> (StatusCode, Value) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, body)
}

async fn create(
    app: &axum::Router,
    customer: &str,
    amount: i64,
    rollback: bool,
) -> (StatusCode, Value) {
    let mut request = Request::post("/v1/subscriptions").header("content-type", "application/json");
    if rollback {
        request = request.header("x-fault", "rollback");
    }
    let body = json!({"customer_id": customer, "plan": "pro", "amount_cents": amount});
    call(app, request.body(Body::from(body.to_string())).unwrap()).await
}

async fn cancel(app: &axum::Router, id: &str) -> (StatusCode, Value) {
    let request = Request::post(format!("/v1/subscriptions/{id}/cancel"))
        .body(Body::empty())
        .unwrap();
    call(app, request).await
}

/// Creates a subscription that must be accepted; returns its id.
async fn subscribe(app: &axum::Router, customer: &str, amount: i64) -> String {
    let (status, body) = create(app, customer, amount, false).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    body["id"].as_str().unwrap().to_owned()
}

// ---------------------------------------------------------------------------
// Watching the consumer: every delivery's event type and outcome.

#[derive(Debug, Clone, PartialEq, Eq)]
enum Observed {
    Ok(Outcome),
    Err(String),
}

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<(String, Observed)>>>);

impl Seen {
    fn all(&self) -> Vec<(String, Observed)> {
        self.0.lock().unwrap().clone()
    }

    fn count(&self, event_type: &str, what: impl Fn(&Observed) -> bool) -> usize {
        self.all()
            .iter()
            .filter(|(t, s)| t == event_type && what(s))
            .count()
    }

    fn duplicates(&self, event_type: &str) -> usize {
        self.count(event_type, |s| *s == Observed::Ok(Outcome::Duplicate))
    }

    fn handled(&self, event_type: &str) -> usize {
        self.count(event_type, |s| *s == Observed::Ok(Outcome::Handled))
    }
}

/// Records what billing's stack did with each delivery, outermost.
#[derive(Clone)]
struct Observe {
    inner: Stack,
    seen: Seen,
}

impl Service<Delivery> for Observe {
    type Response = Outcome;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Outcome, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, delivery: Delivery) -> Self::Future {
        let event_type = delivery.event_type().to_string();
        let seen = self.seen.clone();
        let fut = self.inner.call(delivery);
        Box::pin(async move {
            let out = fut.await;
            let entry = match &out {
                Ok(outcome) => Observed::Ok(*outcome),
                Err(e) => Observed::Err(e.to_string()),
            };
            seen.0.lock().unwrap().push((event_type, entry));
            out
        })
    }
}

// ---------------------------------------------------------------------------

/// Billing commits the invoice and dies before the ack. JetStream redelivers
/// the event to the next process, and the inbox makes it a duplicate: one
/// invoice, one `invoice.created`, however the process died.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_commit_and_ack_makes_one_invoice() {
    let w = world().await;
    let app = w.app(false);
    let subs_relay = w.relay(&w.subs.pool).await;

    // The first billing process freezes right after its first commit.
    let crash = CrashAfterCommitLayer::new(1.0, 1).freeze();
    let first_seen = Seen::default();
    let first = w
        .billing(
            StackOptions::default().crash_after_commit(crash.clone()),
            &first_seen,
        )
        .await;

    let id = subscribe(&app, "cus_crash", 1_500).await;
    wait_until(
        "billing committed, then froze before acking",
        WAIT,
        || async { crash.crashes() == 1 },
    )
    .await
    .unwrap();
    assert_eq!(w.invoices().await, 1, "the invoice is committed");
    first.kill().await; // the process is gone; its delivery was never acked

    let seen = Seen::default();
    let second = w.billing(StackOptions::default(), &seen).await;
    wait_until("the redelivery seen as a duplicate", WAIT, || async {
        seen.duplicates("subscription.created") == 1
    })
    .await
    .unwrap();
    w.wait_settled().await;
    assert_eq!(seen.handled("subscription.created"), 0, "{:?}", seen.all());
    assert_eq!(
        w.invoices_by_subscription().await,
        BTreeMap::from([(id.clone(), 1)])
    );
    assert_eq!(
        support::count(
            &w.billing.pool,
            "select count(*) from outbox_events where event_type = 'invoice.created'"
        )
        .await,
        1
    );
    assert_eq!(
        support::count(
            &w.billing.pool,
            "select count(*) from inbox_events where consumer = 'billing'"
        )
        .await,
        1
    );

    // Billing's own relay publishes its one invoice.created.
    let billing_relay = w.relay(&w.billing.pool).await;
    World::wait_relayed(&w.billing.pool).await;
    assert_eq!(w.stored("invoice.created").await, 1);

    billing_relay.stop().await;
    second.stop().await;
    subs_relay.stop().await;
}

/// The relay publishes `subscription.created` and dies before marking it.
/// Another relay republishes it with the same `Nats-Msg-Id`, which the stream
/// drops; then a copy with a different id — what a republish after the
/// duplicate window looks like — is stored and delivered. Billing still makes
/// one invoice: the inbox, not the broker, is the last line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn republishes_after_a_relay_crash_make_one_invoice() {
    let w = world().await;
    let app = w.app(false);
    let seen = Seen::default();
    let relay = w.relay(&w.subs.pool).await;
    let billing = w.billing(StackOptions::default(), &seen).await;

    let id = subscribe(&app, "cus_republish", 2_000).await;
    w.wait_invoices(1).await;
    World::wait_relayed(&w.subs.pool).await;
    relay.stop().await;
    let event_id: uuid::Uuid = sqlx::query_scalar("select id from outbox_events")
        .fetch_one(&w.subs.pool)
        .await
        .unwrap();

    // A relay that died between publish and mark: the row is unpublished and
    // its lease ran out.
    sqlx::query(
        "update outbox_events
            set published_at = null, locked_until = now() - interval '1 second', next_attempt_at = null
          where id = $1",
    )
    .bind(event_id)
    .execute(&w.subs.pool)
    .await
    .unwrap();
    let second = Relay::jetstream(
        w.subs.pool.clone(),
        w.client.clone(),
        &stream_spec(),
        relay_config(),
    )
    .await
    .unwrap();
    let report = second.drain().await.unwrap();
    assert_eq!((report.published, report.duplicates), (1, 1), "{report:?}");
    assert_eq!(
        w.stored("subscription.created").await,
        1,
        "the stream dropped the republish"
    );

    // Past the duplicate window the stream cannot tell: a copy under another id is stored.
    let stream = w.js.get_stream(STREAM).await.unwrap();
    let original = stream
        .get_last_raw_message_by_subject("subscription.created")
        .await
        .unwrap();
    let dropped = w
        .publish_raw(
            "subscription.created",
            original.payload.to_vec(),
            &format!("{event_id}-late"),
        )
        .await;
    assert!(!dropped);
    assert_eq!(w.stored("subscription.created").await, 2);

    wait_until("the late copy seen as a duplicate", WAIT, || async {
        seen.duplicates("subscription.created") == 1
    })
    .await
    .unwrap();
    w.wait_settled().await;
    assert_eq!(seen.handled("subscription.created"), 1, "{:?}", seen.all());
    assert_eq!(
        w.invoices_by_subscription().await,
        BTreeMap::from([(id, 1)])
    );
    assert_eq!(
        support::count(
            &w.billing.pool,
            "select count(*) from outbox_events where event_type = 'invoice.created'"
        )
        .await,
        1
    );
    billing.stop().await;
}

/// nats-server is killed (`kill -9`) while subscriptions are being created
/// over HTTP, and started again. Requests keep succeeding — they only touch
/// Postgres — and once the broker is back every accepted subscription has
/// exactly one invoice, and none of the rolled-back requests has any.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_mid_traffic_loses_and_doubles_nothing() {
    let mut w = world().await;
    let app = w.app(true);
    let seen = Seen::default();
    let subs_relay = w.relay(&w.subs.pool).await;
    let billing_relay = w.relay(&w.billing.pool).await;
    let billing = w.billing(StackOptions::default(), &seen).await;

    let accepted = Arc::new(Mutex::new(Vec::<String>::new()));
    let rolled_back = Arc::new(Mutex::new(Vec::<String>::new()));
    let traffic = {
        let (app, accepted, rolled_back) = (app.clone(), accepted.clone(), rolled_back.clone());
        tokio::spawn(async move {
            for i in 0..80i64 {
                let customer = format!("cus_{}", i % 7);
                let rollback = i % 5 == 4;
                let (status, body) = create(&app, &customer, 100 + i, rollback).await;
                let id = body["id"].as_str().unwrap().to_owned();
                if rollback {
                    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body}");
                    assert_eq!(body["error"], "injected rollback");
                    rolled_back.lock().unwrap().push(id);
                } else {
                    assert_eq!(status, StatusCode::CREATED, "{body}");
                    accepted.lock().unwrap().push(id);
                }
                tokio::time::sleep(Duration::from_millis(20)).await; // pacing, not waiting
            }
        })
    };

    wait_until("traffic under way", WAIT, || async {
        accepted.lock().unwrap().len() >= 10
    })
    .await
    .unwrap();
    // kill -9 and start_again block briefly on the process: off the async threads.
    tokio::task::block_in_place(|| w.nats.kill()).unwrap();
    let at_kill = accepted.lock().unwrap().len();
    wait_until(
        "subscriptions accepted while the broker is down",
        WAIT,
        || async { accepted.lock().unwrap().len() >= at_kill + 16 },
    )
    .await
    .unwrap();
    tokio::task::block_in_place(|| w.nats.start_again()).unwrap();
    traffic.await.unwrap();

    let accepted: BTreeSet<String> = accepted.lock().unwrap().iter().cloned().collect();
    let rolled_back: BTreeSet<String> = rolled_back.lock().unwrap().iter().cloned().collect();
    assert_eq!(accepted.len(), 64);
    assert_eq!(rolled_back.len(), 16);
    w.wait_invoices(accepted.len() as i64).await;
    World::wait_relayed(&w.subs.pool).await;
    w.wait_settled().await;

    let invoices = w.invoices_by_subscription().await;
    let expected: BTreeMap<String, i64> = accepted.iter().map(|id| (id.clone(), 1)).collect();
    assert_eq!(
        invoices, expected,
        "exactly one invoice per accepted subscription"
    );
    assert!(invoices.keys().all(|id| !rolled_back.contains(id)));
    assert_eq!(
        support::count(&w.subs.pool, "select count(*) from subscriptions").await,
        accepted.len() as i64,
        "rolled-back requests left no row"
    );
    assert_eq!(
        support::count(&w.subs.pool, "select count(*) from outbox_events").await,
        accepted.len() as i64,
        "rolled-back requests left no event"
    );
    World::wait_relayed(&w.billing.pool).await;
    // At least once: a PubAck lost in the kill is republished (normally dropped by the stream).
    assert!(w.stored("invoice.created").await >= accepted.len());

    billing.stop().await;
    billing_relay.stop().await;
    subs_relay.stop().await;
}

/// `subscription.cancelled` reaches billing before `subscription.created`
/// (published in reverse order). The cancellation finds no invoice and is
/// retried; the creation raises the invoice; the retried cancellation voids
/// it. Applied in creation order, whatever the arrival order.
///
/// Billing runs `--unordered` here: the stream itself holds the cancellation
/// first, and an ordered consumer applies a subject's events in stream order,
/// so the cancellation would hold its creation back until dead-lettered. (Our
/// relay never publishes a subject out of order; this is what a handler must
/// survive when something else does.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_that_overtakes_its_creation_waits_for_it() {
    let w = world().await;
    let app = w.app(false);
    let id = subscribe(&app, "cus_order", 900).await;
    let (status, body) = cancel(&app, &id).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _) = cancel(&app, &id).await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "a second cancel writes nothing"
    );

    // Both events are in the service's outbox; publish them in reverse order,
    // as relays would, body and Nats-Msg-Id included.
    stream_spec().ensure(&w.js).await.unwrap();
    let rows: Vec<(uuid::Uuid, String)> = sqlx::query_as(
        "select id, event_type from outbox_events order by created_at desc, id desc",
    )
    .fetch_all(&w.subs.pool)
    .await
    .unwrap();
    assert_eq!(
        rows.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>(),
        ["subscription.cancelled", "subscription.created"]
    );
    for (event_id, event_type) in &rows {
        let envelope = envelope_of(&w.subs.pool, *event_id).await;
        w.publish_raw(event_type, envelope, &event_id.to_string())
            .await;
    }

    let seen = Seen::default();
    let billing = w.billing_with(StackOptions::default(), &seen, false).await;
    wait_until("the invoice voided", WAIT, || async {
        support::count(
            &w.billing.pool,
            "select count(*) from invoices where voided_at is not null",
        )
        .await
            == 1
    })
    .await
    .unwrap();
    w.wait_settled().await;

    let order: Vec<(String, Observed)> = seen.all();
    let failed_cancel = order
        .iter()
        .position(|(t, s)| {
            t == "subscription.cancelled"
                && matches!(s, Observed::Err(e) if e.contains("no invoice yet"))
        })
        .unwrap_or_else(|| panic!("the early cancellation is retried: {order:?}"));
    let created = order
        .iter()
        .position(|(t, s)| t == "subscription.created" && *s == Observed::Ok(Outcome::Handled))
        .unwrap();
    let cancelled = order
        .iter()
        .position(|(t, s)| t == "subscription.cancelled" && *s == Observed::Ok(Outcome::Handled))
        .unwrap();
    assert!(failed_cancel < created && created < cancelled, "{order:?}");
    assert_eq!(
        w.invoices_by_subscription().await,
        BTreeMap::from([(id, 1)])
    );
    billing.stop().await;
}

/// The envelope JSON of an outbox row, as the relay builds it.
async fn envelope_of(pool: &PgPool, id: uuid::Uuid) -> Vec<u8> {
    let (event_type, source, subject, time, data): (
        String,
        String,
        String,
        chrono::DateTime<chrono::Utc>,
        Value,
    ) = sqlx::query_as(
        "select event_type, source, subject, time, data from outbox_events where id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap();
    outbox_pg::Envelope::from_parts(
        outbox_pg::EventId::from_uuid(id),
        event_type,
        source,
        subject,
        time,
        data,
    )
    .unwrap()
    .to_json()
    .unwrap()
}
