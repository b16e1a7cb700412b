//! Ordered consumption (`ConsumerConfig::ordered`) against a real nats-server
//! and PostgreSQL: replicas of one durable never handle two events of a
//! subject at once, apply them in stream order, and fail over when the leader
//! dies, losing and repeating nothing.

mod support;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use inbox_consumer::{
    BoxError, Consumer, ConsumerConfig, DedupeLayer, Delivery, Handler, HandlerError,
    HandlerService, Outcome, RetryPolicy, Router,
};
use outbox_pg::{Envelope, Outbox, SchemaRegistry};
use outbox_testkit::{NatsHandle, TestDb, wait_until};
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::{PgPool, PgTransaction};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::{Service, ServiceBuilder, ServiceExt};

const WAIT: Duration = Duration::from_secs(60);

struct World {
    db: TestDb,
    _nats: NatsHandle,
    js: jetstream::Context,
}

async fn world(stream: &str, subjects: &[&str]) -> World {
    let db = TestDb::new().await.unwrap();
    outbox_pg::migrate(&db.pool).await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_stream(stream::Config {
        name: stream.into(),
        subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
        ..Default::default()
    })
    .await
    .unwrap();
    World {
        db,
        _nats: nats,
        js,
    }
}

/// `(n, subject, seq)` rows, `n` in commit order (per subject, with one event
/// of a subject at a time).
const EFFECTS: &str =
    "create table effects (n bigserial primary key, subject text not null, seq bigint not null)";

/// A world whose database has the [`EFFECTS`] table.
async fn world_with_effects(stream: &str) -> World {
    let w = world(stream, &["o.>"]).await;
    sqlx::query(EFFECTS).execute(&w.db.pool).await.unwrap();
    w
}

impl World {
    /// The leader epoch of `consumer`.
    async fn epoch(&self, consumer: &str) -> i64 {
        sqlx::query_scalar("select epoch from inbox_leases where consumer = $1")
            .bind(consumer)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    async fn count(&self, sql: &str) -> i64 {
        support::count(&self.db.pool, sql).await
    }

    /// Publishes every event as the relay does (body = envelope, `Nats-Msg-Id` = id),
    /// then waits for all the acks.
    async fn publish_all(&self, events: &[Envelope<Value>]) {
        support::publish_envelopes(&self.js, events).await;
    }

    async fn wait_settled(&self, stream: &str, durable: &str) {
        support::wait_acked(&self.js, stream, durable, WAIT).await;
    }
}

/// One replica: its own pool (as its own process would have), its run task.
struct Replica {
    name: &'static str,
    pool: PgPool,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<inbox_consumer::Result<()>>,
}

impl Replica {
    async fn start<S>(
        name: &'static str,
        w: &World,
        config: ConsumerConfig,
        service: impl FnOnce(PgPool) -> S,
    ) -> Self
    where
        S: Service<Delivery, Response = Outcome> + Clone + Send + 'static,
        S::Error: Into<BoxError>,
        S::Future: Send + 'static,
    {
        let pool = PgPool::connect(w.db.url()).await.unwrap();
        let consumer = Consumer::new(pool.clone(), w.js.clone(), config)
            .await
            .unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run(service(pool.clone()), async {
            let _ = stopped.await;
        }));
        Self {
            name,
            pool,
            stop: Some(stop),
            task,
        }
    }

    /// Dies like a killed process: everything in flight is dropped unacked,
    /// its transactions roll back, its sessions close.
    async fn crash(self) {
        self.task.abort();
        let _ = self.task.await;
        self.pool.close().await;
    }

    async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("graceful shutdown finishes")
            .unwrap()
            .unwrap();
    }
}

/// Counts, across every replica, the deliveries of each subject running at
/// once: the outermost layer, around the transaction and its commit.
#[derive(Clone, Default)]
struct InFlight {
    running: Arc<Mutex<HashMap<String, usize>>>,
    max: Arc<AtomicUsize>,
    handled: Arc<Mutex<HashMap<&'static str, usize>>>,
}

impl InFlight {
    fn max(&self) -> usize {
        self.max.load(Ordering::SeqCst)
    }

    fn handled_by(&self, replica: &'static str) -> usize {
        self.handled
            .lock()
            .unwrap()
            .get(replica)
            .copied()
            .unwrap_or(0)
    }

    fn wrap<S>(&self, replica: &'static str, inner: S) -> Tracked<S> {
        Tracked {
            inner,
            replica,
            state: self.clone(),
        }
    }
}

#[derive(Clone)]
struct Tracked<S> {
    inner: S,
    replica: &'static str,
    state: InFlight,
}

impl<S> Service<Delivery> for Tracked<S>
where
    S: Service<Delivery, Response = Outcome> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Outcome, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, delivery: Delivery) -> Self::Future {
        let subject = delivery.subject().to_owned();
        let state = self.state.clone();
        let replica = self.replica;
        let now = {
            let mut running = state.running.lock().unwrap();
            let n = running.entry(subject.clone()).or_default();
            *n += 1;
            *n
        };
        state.max.fetch_max(now, Ordering::SeqCst);
        let fut = self.inner.call(delivery);
        Box::pin(async move {
            // Leave the count even when the future is dropped (a crash).
            struct Leave(InFlight, String);
            impl Drop for Leave {
                fn drop(&mut self) {
                    if let Some(n) = self.0.running.lock().unwrap().get_mut(&self.1) {
                        *n -= 1;
                    }
                }
            }
            let _leave = Leave(state.clone(), subject);
            let out = fut.await.map_err(Into::into);
            if out.is_ok() {
                *state.handled.lock().unwrap().entry(replica).or_default() += 1;
            }
            out
        })
    }
}

// ---------------------------------------------------------------------------

#[derive(Deserialize)]
struct Step {
    seq: i64,
    /// Attempts that fail (retryable) before one succeeds.
    #[serde(default)]
    fail: usize,
}

/// Appends `(subject, seq)` to `effects`, slow enough that events overlap;
/// fails the first `fail` attempts of an event.
#[derive(Clone, Default)]
struct Append {
    attempts: Arc<Mutex<HashMap<String, usize>>>,
}

impl Handler for Append {
    type Message = Step;

    async fn handle(
        &self,
        event: Envelope<Step>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        let attempt = {
            let mut attempts = self.attempts.lock().unwrap();
            let n = attempts.entry(event.id().to_string()).or_default();
            *n += 1;
            *n
        };
        if attempt <= event.data().fail {
            return Err(HandlerError::retry(format!("attempt {attempt} fails")));
        }
        sqlx::query("select pg_sleep(0.002)")
            .execute(&mut **tx)
            .await?;
        sqlx::query("insert into effects (subject, seq) values ($1, $2)")
            .bind(event.subject())
            .bind(event.data().seq)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Dedupe in front of the handlers, as a replica runs them.
type Stack =
    inbox_consumer::Dedupe<Router<inbox_consumer::InTx<Delivery>, inbox_consumer::InTx<Outcome>>>;

/// The stack of one replica: dedupe → [`Append`], behind the tracker.
fn tracked_append(tracker: &InFlight, name: &'static str) -> impl FnOnce(PgPool) -> Tracked<Stack> {
    let tracker = tracker.clone();
    move |pool: PgPool| {
        tracker.wrap(
            name,
            ServiceBuilder::new()
                .layer(DedupeLayer::new(pool))
                .service(Router::new().route("o.step", HandlerService::new(Append::default()))),
        )
    }
}

/// `per_subject` events (`seq` 0, 1, …) for each of `subjects` subjects,
/// interleaved across subjects in publish order.
fn steps(subjects: u32, per_subject: u32) -> Vec<Envelope<Value>> {
    (0..per_subject)
        .flat_map(|seq| {
            (0..subjects).map(move |s| {
                Envelope::new("o.step", "tests", format!("sub_{s}"), json!({"seq": seq})).unwrap()
            })
        })
        .collect()
}

/// Every event applied once, each subject's in stream order, never two of a
/// subject in flight at once.
async fn assert_applied_once_in_order(
    w: &World,
    tracker: &InFlight,
    subjects: u32,
    per_subject: u32,
) {
    assert_eq!(
        w.count("select count(*) from effects").await,
        i64::from(subjects * per_subject),
        "no effect repeated"
    );
    assert_each_subject_in_stream_order(&w.db.pool, subjects, per_subject).await;
    assert_eq!(
        tracker.max(),
        1,
        "two events of one subject were in flight at once"
    );
}

/// Every subject's effects are exactly `0..per_subject`, in that order.
async fn assert_each_subject_in_stream_order(pool: &PgPool, subjects: u32, per_subject: u32) {
    let expected: Vec<i64> = (0..i64::from(per_subject)).collect();
    let by_subject = effects_by_subject(pool).await;
    assert_eq!(by_subject.len(), subjects as usize);
    for (subject, seqs) in &by_subject {
        assert_eq!(
            seqs, &expected,
            "{subject}: effects not in stream order, or missing"
        );
    }
}

fn ordered_config(stream: &str, durable: &str) -> ConsumerConfig {
    ConsumerConfig::new(stream, durable)
        .ordered(true)
        .lease_timeout(Duration::from_secs(6))
        .concurrency(8)
        .ack_wait(Duration::from_secs(3))
        .max_deliver(20)
        .retry(
            RetryPolicy::default()
                .base(Duration::from_millis(50))
                .max(Duration::from_millis(500)),
        )
}

/// Once a replica leads and `sql` counts `n`, crashes the leader. Returns the
/// survivor and what it had handled by then.
async fn crash_the_leader_once(
    w: &World,
    tracker: &InFlight,
    replicas: [Replica; 2],
    sql: &str,
    n: i64,
) -> (Replica, usize) {
    let [a, b] = replicas;
    let lead = leader(tracker, [a.name, b.name]).await;
    wait_until(&format!("{sql} >= {n}"), WAIT, || async {
        w.count(sql).await >= n
    })
    .await
    .unwrap();
    let (crashed, survivor) = if lead == a.name { (a, b) } else { (b, a) };
    assert_eq!(crashed.name, lead);
    let before = tracker.handled_by(survivor.name);
    crashed.crash().await;
    (survivor, before)
}

/// Which replica leads: the one that has handled something.
async fn leader(a: &InFlight, names: [&'static str; 2]) -> &'static str {
    wait_until("a leader handles events", WAIT, || async {
        names.iter().any(|n| a.handled_by(n) > 0)
    })
    .await
    .unwrap();
    let [first, second] = names;
    assert!(
        a.handled_by(first) == 0 || a.handled_by(second) == 0,
        "both replicas handled events before any failover"
    );
    if a.handled_by(first) > 0 {
        first
    } else {
        second
    }
}

#[tokio::test]
async fn ordered_replicas_handle_a_subject_one_event_at_a_time_in_stream_order_across_a_leader_crash()
 {
    let w = world_with_effects("ORDERED").await;
    let tracker = InFlight::default();
    let service = |name: &'static str| tracked_append(&tracker, name);
    let a = Replica::start("a", &w, ordered_config("ORDERED", "ordered"), service("a")).await;
    let b = Replica::start("b", &w, ordered_config("ORDERED", "ordered"), service("b")).await;

    let (subjects, per_subject) = (100, 20);
    let events = steps(subjects, per_subject);
    w.publish_all(&events).await;

    // Crash the leader a third of the way through.
    let (survivor, before) =
        crash_the_leader_once(&w, &tracker, [a, b], "select count(*) from effects", 600).await;

    let total = i64::from(subjects * per_subject);
    wait_until("every event applied", WAIT, || async {
        w.count("select count(*) from effects").await >= total
    })
    .await
    .unwrap();
    w.wait_settled("ORDERED", "ordered").await;

    assert_eq!(
        before, 0,
        "the standby handled nothing while the leader lived"
    );
    assert!(
        tracker.handled_by(survivor.name) > 0,
        "the standby took over"
    );
    assert_applied_once_in_order(&w, &tracker, subjects, per_subject).await;
    assert_eq!(
        w.epoch("ordered").await,
        2,
        "one leader, then one successor"
    );
    survivor.shutdown().await;
}

/// Billing's handlers behind the tracker, counting cancellations that found no invoice.
fn billing(
    tracker: &InFlight,
    name: &'static str,
    early: Arc<AtomicUsize>,
) -> impl FnOnce(PgPool) -> Tracked<Counting<Stack>> {
    let tracker = tracker.clone();
    move |pool: PgPool| {
        let outbox =
            Outbox::new(SchemaRegistry::from_dir(example_billing::default_schemas_dir()).unwrap());
        tracker.wrap(
            name,
            Counting {
                inner: inbox_consumer::Dedupe::new(example_billing::handlers(outbox), pool),
                early,
            },
        )
    }
}

/// Counts deliveries that failed with `NotInvoicedYet` (the retry dance).
#[derive(Clone)]
struct Counting<S> {
    inner: S,
    early: Arc<AtomicUsize>,
}

impl<S> Service<Delivery> for Counting<S>
where
    S: Service<Delivery, Response = Outcome, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Outcome;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Outcome, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, delivery: Delivery) -> Self::Future {
        let early = self.early.clone();
        let fut = self.inner.call(delivery);
        Box::pin(async move {
            let out = fut.await;
            if let Err(e) = &out
                && e.downcast_ref::<HandlerError>().is_some_and(|h| {
                    h.get_ref()
                        .downcast_ref::<example_billing::NotInvoicedYet>()
                        .is_some()
                })
            {
                early.fetch_add(1, Ordering::SeqCst);
            }
            out
        })
    }
}

#[tokio::test]
async fn ordered_billing_voids_every_invoice_of_1000_subscriptions_created_and_cancelled_together()
{
    let w = world("ORDERED_BILLING", &["subscription.>", "invoice.>"]).await;
    example_billing::migrate(&w.db.pool).await.unwrap();
    let tracker = InFlight::default();
    let early = Arc::new(AtomicUsize::new(0));
    let config = || {
        example_billing::consumer_config("ORDERED_BILLING", "billing")
            .ordered(true)
            .lease_timeout(Duration::from_secs(6))
            .ack_wait(Duration::from_secs(3))
    };
    let a = Replica::start("a", &w, config(), billing(&tracker, "a", early.clone())).await;
    let b = Replica::start("b", &w, config(), billing(&tracker, "b", early.clone())).await;

    let n = 1_000;
    let mut events = Vec::new();
    for i in 0..n {
        let subscription = format!("sub_{i:04}");
        let data = json!({"subscription_id": subscription, "customer_id": "cus_1", "plan": "pro", "amount_cents": 100});
        events.push(
            Envelope::new("subscription.created", "subscriptions", &subscription, data).unwrap(),
        );
        let data = json!({"subscription_id": subscription, "customer_id": "cus_1"});
        events.push(
            Envelope::new(
                "subscription.cancelled",
                "subscriptions",
                &subscription,
                data,
            )
            .unwrap(),
        );
    }
    w.publish_all(&events).await;

    // The leader crashes part-way; the standby finishes.
    let (survivor, _) = crash_the_leader_once(
        &w,
        &tracker,
        [a, b],
        "select count(*) from inbox_events",
        500,
    )
    .await;

    wait_until("every invoice voided", WAIT, || async {
        w.count("select count(*) from invoices where voided_at is not null")
            .await
            >= n
    })
    .await
    .unwrap();
    w.wait_settled("ORDERED_BILLING", "billing").await;

    assert_eq!(
        w.count("select count(*) from invoices").await,
        n,
        "one invoice per subscription"
    );
    assert_eq!(
        w.count("select count(*) from invoices where voided_at is null")
            .await,
        0
    );
    assert_eq!(
        w.count("select count(distinct subscription_id) from invoices")
            .await,
        n
    );
    assert_eq!(w.count("select count(*) from inbox_events").await, 2 * n);
    assert_eq!(w.count("select count(*) from inbox_dead_letters").await, 0);
    assert_eq!(
        tracker.max(),
        1,
        "two events of one subscription were in flight at once"
    );
    assert_eq!(
        early.load(Ordering::SeqCst),
        0,
        "a cancellation ran before its creation (the retry dance)"
    );
    survivor.shutdown().await;
}

async fn effects_by_subject(pool: &PgPool) -> HashMap<String, Vec<i64>> {
    let rows: Vec<(String, i64)> = sqlx::query_as("select subject, seq from effects order by n")
        .fetch_all(pool)
        .await
        .unwrap();
    let mut by_subject: HashMap<String, Vec<i64>> = HashMap::new();
    for (subject, seq) in rows {
        by_subject.entry(subject).or_default().push(seq);
    }
    by_subject
}

#[tokio::test]
async fn a_failing_event_holds_back_its_subject_only_and_poison_holds_back_nothing() {
    let w = world_with_effects("ORDERED_RETRY").await;
    let handler = Append::default();
    let service = |pool: PgPool| {
        ServiceBuilder::new()
            .layer(DedupeLayer::new(pool))
            .service(Router::new().route("o.step", HandlerService::new(handler.clone())))
    };
    let replica = Replica::start("a", &w, ordered_config("ORDERED_RETRY", "retry"), service).await;

    // s: its first event fails three times; t: never fails. A poison message sits between.
    let events = [
        Envelope::new("o.step", "tests", "s", json!({"seq": 0, "fail": 3})).unwrap(),
        Envelope::new("o.step", "tests", "t", json!({"seq": 0})).unwrap(),
        Envelope::new("o.step", "tests", "s", json!({"seq": 1})).unwrap(),
        Envelope::new("o.step", "tests", "t", json!({"seq": 1})).unwrap(),
        Envelope::new("o.step", "tests", "s", json!({"seq": 2})).unwrap(),
    ];
    w.publish_all(&events[..2]).await;
    w.js.publish("o.step", "not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    w.publish_all(&events[2..]).await;

    wait_until("every effect", WAIT, || async {
        w.count("select count(*) from effects").await >= 5
    })
    .await
    .unwrap();
    w.wait_settled("ORDERED_RETRY", "retry").await;
    let by_subject = effects_by_subject(&w.db.pool).await;
    assert_eq!(
        by_subject["s"],
        vec![0, 1, 2],
        "s's later events waited for its retried first"
    );
    assert_eq!(by_subject["t"], vec![0, 1]);
    let order: Vec<String> = sqlx::query_scalar("select subject || seq from effects order by n")
        .fetch_all(&w.db.pool)
        .await
        .unwrap();
    assert!(
        order.iter().position(|e| e == "t1") < order.iter().position(|e| e == "s0"),
        "t went on while s retried: {order:?}"
    );
    assert_eq!(
        w.count("select count(*) from inbox_dead_letters where reason = 'not_json'")
            .await,
        1
    );
    replica.shutdown().await;
}

/// A database whose consumer `fenced` has a lease of `epoch`, and the dedupe
/// stack over [`Append`] a fenced delivery goes through.
async fn fenced(
    epoch: i64,
) -> (
    TestDb,
    impl Service<Delivery, Response = Outcome, Error = tower::BoxError, Future: Send> + Clone + Send,
) {
    let db = TestDb::new().await.unwrap();
    sqlx::query(EFFECTS).execute(&db.pool).await.unwrap();
    sqlx::query(
        "insert into inbox_leases (consumer, epoch, holder) values ('fenced', $1, 'a leader')",
    )
    .bind(epoch)
    .execute(&db.pool)
    .await
    .unwrap();
    let stack = ServiceBuilder::new()
        .layer(DedupeLayer::new(db.pool.clone()))
        .service(Router::new().route("o.step", HandlerService::new(Append::default())));
    (db, stack)
}

/// A delivery to `fenced`, stamped with `epoch`.
fn delivery(epoch: i64) -> Delivery {
    let event = Envelope::new("o.step", "tests", "s", json!({"seq": 0})).unwrap();
    Delivery::new(event, inbox_consumer::DeliveryInfo::new("fenced")).with_leader_epoch(epoch)
}

#[tokio::test]
async fn a_transaction_of_a_deposed_leader_rolls_back_and_is_left_unacked() {
    // The fence, directly: a delivery stamped with an old epoch cannot commit.
    let (db, stack) = fenced(2).await;

    let err = stack.clone().oneshot(delivery(1)).await.unwrap_err();
    let err = err.downcast_ref::<inbox_consumer::Error>().unwrap();
    assert_eq!(err.kind(), inbox_consumer::ErrorKind::LeaseLost, "{err}");
    let count = |sql: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(count("select count(*) from effects").await, 0);
    assert_eq!(count("select count(*) from inbox_events").await, 0);

    assert_eq!(stack.oneshot(delivery(2)).await.unwrap(), Outcome::Handled);
    assert_eq!(count("select count(*) from effects").await, 1);
}

#[tokio::test]
async fn a_commit_waits_for_a_new_leader_holding_the_fence_on_the_keys_earlier_versions_use() {
    // A new leader of any version takes the fence exclusive on these keys,
    // computed in SQL as every version has (the schema part is '' in
    // `public`); a commit of the old epoch must wait for it, then roll back.
    let (db, stack) = fenced(1).await;
    let mut leader = db.pool.begin().await.unwrap();
    sqlx::query(
        "select pg_advisory_xact_lock(hashtext('inbox_consumer.fence' || ''), hashtext('fenced'))",
    )
    .execute(&mut *leader)
    .await
    .unwrap();
    let commit = tokio::spawn(stack.oneshot(delivery(1)));
    let pool = db.pool.clone();
    wait_until(
        "the commit waits on the fence",
        Duration::from_secs(10),
        || {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(
                    "select count(*) from pg_locks where locktype = 'advisory' and not granted \
                     and database = (select oid from pg_database where datname = current_database())",
                )
                .fetch_one(&pool)
                .await
                .unwrap()
                    == 1
            }
        },
    )
    .await
    .unwrap();
    assert!(!commit.is_finished());
    sqlx::query(
        "update inbox_leases set epoch = 2, holder = 'the new leader' where consumer = 'fenced'",
    )
    .execute(&mut *leader)
    .await
    .unwrap();
    leader.commit().await.unwrap();
    let err = commit.await.unwrap().unwrap_err();
    let err = err.downcast_ref::<inbox_consumer::Error>().unwrap();
    assert_eq!(err.kind(), inbox_consumer::ErrorKind::LeaseLost, "{err}");
    let effects: i64 = sqlx::query_scalar("select count(*) from effects")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(effects, 0);
}

#[tokio::test]
async fn a_leader_that_loses_its_database_session_steps_down_and_the_standby_goes_on_in_order() {
    let w = world_with_effects("ORDERED_SESSION").await;
    let tracker = InFlight::default();
    let service = |name: &'static str| tracked_append(&tracker, name);
    let a = Replica::start(
        "a",
        &w,
        ordered_config("ORDERED_SESSION", "session"),
        service("a"),
    )
    .await;
    let b = Replica::start(
        "b",
        &w,
        ordered_config("ORDERED_SESSION", "session"),
        service("b"),
    )
    .await;

    let (subjects, per_subject) = (50, 20);
    let events = steps(subjects, per_subject);
    w.publish_all(&events[..500]).await;
    leader(&tracker, ["a", "b"]).await; // one replica leads, the other stands by
    wait_until("some handled", WAIT, || async {
        w.count("select count(*) from effects").await >= 200
    })
    .await
    .unwrap();

    // The server ends the leader's leadership session (as idle_session_timeout
    // or an operator would); the process itself lives on.
    let terminated: i64 = sqlx::query_scalar(
        "select count(pg_terminate_backend(pid)) from pg_locks
          where locktype = 'advisory' and granted and objsubid = 2
            and database = (select oid from pg_database where datname = current_database())
            and classid::bigint = (hashtext('inbox_consumer.leader')::bigint + 4294967296) % 4294967296",
    )
    .fetch_one(&w.db.pool)
    .await
    .unwrap();
    assert_eq!(terminated, 1, "one leadership session");
    w.publish_all(&events[500..]).await;

    let total = i64::from(subjects * per_subject);
    wait_until("every event applied", WAIT, || async {
        w.count("select count(*) from effects").await >= total
    })
    .await
    .unwrap();
    w.wait_settled("ORDERED_SESSION", "session").await;
    assert_applied_once_in_order(&w, &tracker, subjects, per_subject).await;
    let epoch = w.epoch("session").await;
    assert!(epoch >= 2, "a new leader took over (epoch {epoch})");
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn shutdown_stops_an_in_place_retry_and_leaves_the_event_to_the_next_leader() {
    let w = world_with_effects("ORDERED_STOP").await;
    let handler = Append::default();
    let service = |pool: PgPool| {
        ServiceBuilder::new()
            .layer(DedupeLayer::new(pool))
            .service(Router::new().route("o.step", HandlerService::new(handler.clone())))
    };
    // A long retry delay: only an interrupted wait lets shutdown finish soon.
    let config = ordered_config("ORDERED_STOP", "stop")
        .retry(RetryPolicy::default().base(Duration::from_secs(60)));
    let replica = Replica::start("a", &w, config, service).await;
    let event = Envelope::new("o.step", "tests", "s", json!({"seq": 0, "fail": 1})).unwrap();
    // The next event of the subject waits behind it and must not overtake it.
    let next = Envelope::new("o.step", "tests", "s", json!({"seq": 1})).unwrap();
    w.publish_all(&[event.clone(), next]).await;
    wait_until("the first attempt failed", WAIT, || async {
        handler
            .attempts
            .lock()
            .unwrap()
            .get(&event.id().to_string())
            .copied()
            == Some(1)
    })
    .await
    .unwrap();

    let started = std::time::Instant::now();
    let Replica { stop, task, .. } = replica;
    let _ = stop.unwrap().send(());
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("shutdown does not wait out the retry delay")
        .unwrap()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        w.count("select count(*) from effects").await,
        0,
        "nothing applied: the later event did not overtake the unfinished one"
    );
    let stream = w.js.get_stream("ORDERED_STOP").await.unwrap();
    let info = stream.consumer_info("stop").await.unwrap();
    assert_eq!(
        info.num_ack_pending, 2,
        "both events are left unacked for the next leader"
    );

    // The next leader (a clean handover: no wait) applies them, in order, once
    // they come back.
    let replica = Replica::start("b", &w, ordered_config("ORDERED_STOP", "stop"), service).await;
    wait_until("both events applied by the next leader", WAIT, || async {
        w.count("select count(*) from effects").await == 2
    })
    .await
    .unwrap();
    w.wait_settled("ORDERED_STOP", "stop").await;
    replica.shutdown().await;
    let order: Vec<i64> = sqlx::query_scalar("select seq from effects order by n")
        .fetch_all(&w.db.pool)
        .await
        .unwrap();
    assert_eq!(order, [0, 1], "applied in stream order");
}

// ---------------------------------------------------------------------------
// A takeover with one message left unacked far behind everything handled.

/// Appends `(subject, seq)` to `effects` for subject `stuck` only (the others
/// leave just their inbox row, to be quick), recording when each event is
/// handled; on the replica whose `block` is set, hangs for ever on `stuck`'s
/// first event, so the consumer's ack floor stays below it.
#[derive(Clone, Default)]
struct Stuck {
    block: bool,
    handled: Arc<Mutex<Vec<std::time::Instant>>>,
}

impl Handler for Stuck {
    type Message = Step;

    async fn handle(
        &self,
        event: Envelope<Step>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        if event.subject() == "stuck" {
            if self.block && event.data().seq == 0 {
                std::future::pending::<()>().await;
            }
            sqlx::query("insert into effects (subject, seq) values ($1, $2)")
                .bind(event.subject())
                .bind(event.data().seq)
                .execute(&mut **tx)
                .await?;
        }
        self.handled.lock().unwrap().push(std::time::Instant::now());
        Ok(())
    }
}

/// What a takeover behind a stuck message took.
#[derive(Debug)]
struct Failover {
    /// From the leader's death to the first event the new leader handled.
    first: Duration,
    /// From the leader's death to every event handled, the stuck ones included.
    all: Duration,
    /// The checkpoint the dead leader left: its sequence and how many it listed.
    checkpoint: Option<(i64, usize)>,
    /// The ack floor and the last delivered stream sequence at the takeover.
    range: (u64, u64),
}

/// How the takeover finds what the dead leader left.
#[derive(Clone, Copy, PartialEq)]
enum Scan {
    /// From the dead leader's checkpoint.
    Checkpoint,
    /// The checkpoint erased: from the ack floor, in bulk.
    FromTheFloor,
    /// From the ack floor, with a bound far below the range.
    Bounded,
}

/// `stuck`'s first event left unacked on leader `a` (its handler hangs, with
/// `stuck`'s next two events queued behind it), `n` events of 100 other
/// subjects after it handled and acked; then `a` dies, 100 new events
/// arrive, and standby `b` takes over. Asserts that every event is handled
/// once, `stuck`'s in stream order, and returns the times.
async fn takeover_behind_a_stuck_message(stream: &str, n: usize, scan: Scan) -> Failover {
    let w = world_with_effects(stream).await;
    let durable = "stuck";
    let config = || {
        let config = ordered_config(stream, durable)
            .concurrency(32)
            .max_buffered(1_024)
            .batch(256)
            .max_ack_pending(2_000);
        match scan {
            Scan::Bounded => config.takeover_scan(500, Duration::from_secs(5)),
            _ => config,
        }
    };
    let service = |handler: Stuck| {
        move |pool: PgPool| {
            ServiceBuilder::new()
                .layer(DedupeLayer::new(pool))
                .service(Router::new().route("o.step", HandlerService::new(handler)))
        }
    };
    let (on_a, on_b) = (
        Stuck {
            block: true,
            ..Stuck::default()
        },
        Stuck::default(),
    );
    let a = Replica::start("a", &w, config(), service(on_a.clone())).await;
    wait_until("a leads", WAIT, || async {
        w.count("select count(*) from inbox_leases").await == 1
    })
    .await
    .unwrap();
    let b = Replica::start("b", &w, config(), service(on_b.clone())).await;

    let stuck = |seq: i64| Envelope::new("o.step", "tests", "stuck", json!({"seq": seq})).unwrap();
    let others = |from: usize, count: usize| -> Vec<Envelope<Value>> {
        (from..from + count)
            .map(|i| {
                let (subject, seq) = (format!("sub_{}", i % 100), i / 100);
                Envelope::new("o.step", "tests", subject, json!({"seq": seq})).unwrap()
            })
            .collect()
    };
    w.publish_all(&[stuck(0)]).await;
    // In chunks: the client lets 5,000 publish acks be outstanding at once.
    for chunk in others(0, n).chunks(1_000) {
        w.publish_all(chunk).await;
    }
    w.publish_all(&[stuck(1), stuck(2)]).await;
    let n = i64::try_from(n).unwrap();
    wait_until(
        "a handled everything after the stuck event",
        WAIT * 5,
        || async { w.count("select count(*) from inbox_events").await == n },
    )
    .await
    .unwrap();
    // The stuck event and the two behind it are all that is open: once the
    // checkpoint says so, it stands just past them.
    let last = u64::try_from(n).unwrap() + 3;
    let checkpoint = || async {
        sqlx::query_as::<_, (Option<i64>, Vec<i64>)>(
            "select checkpoint_seq, checkpoint_pending from inbox_leases where consumer = $1",
        )
        .bind(durable)
        .fetch_one(&w.db.pool)
        .await
        .unwrap()
    };
    wait_until("a's checkpoint caught up", WAIT, || async {
        let (seq, pending) = checkpoint().await;
        seq == Some(i64::try_from(last).unwrap()) && pending.len() == 3
    })
    .await
    .unwrap();
    let (seq, pending) = checkpoint().await;
    assert_eq!(
        pending,
        [1, n + 2, n + 3],
        "the checkpoint lists the stuck event and the two behind it"
    );
    let left = seq.map(|s| (s, pending.len()));
    let info =
        w.js.get_stream(stream)
            .await
            .unwrap()
            .consumer_info(durable)
            .await
            .unwrap()
            .clone();
    let range = (
        info.ack_floor.stream_sequence,
        info.delivered.stream_sequence,
    );
    assert_eq!(
        range,
        (0, last),
        "the ack floor is held below the stuck event"
    );

    let killed = std::time::Instant::now();
    a.crash().await;
    if scan != Scan::Checkpoint {
        // Within the 1.75 s the new leader waits for a's last pull.
        sqlx::query("update inbox_leases set checkpoint_seq = null, checkpoint_pending = '{}'")
            .execute(&w.db.pool)
            .await
            .unwrap();
    }
    let fresh = others(n as usize, 100);
    w.publish_all(&fresh).await;
    wait_until("b handles a first event", WAIT, || async {
        !on_b.handled.lock().unwrap().is_empty()
    })
    .await
    .unwrap();
    let first = *on_b.handled.lock().unwrap().first().unwrap() - killed;
    wait_until("every event handled", WAIT, || async {
        w.count("select count(*) from inbox_events").await == n + 103
    })
    .await
    .unwrap();
    let all = on_b.handled.lock().unwrap().last().copied().unwrap() - killed;
    w.wait_settled(stream, durable).await;
    // The new leader's checkpoint reaches the end, nothing listed (after a
    // bounded scan, through its catch-up).
    wait_until("b's checkpoint caught up", WAIT, || async {
        checkpoint().await == (Some(i64::try_from(last).unwrap() + 100), Vec::new())
    })
    .await
    .unwrap();
    let order: Vec<i64> =
        sqlx::query_scalar("select seq from effects where subject = 'stuck' order by n")
            .fetch_all(&w.db.pool)
            .await
            .unwrap();
    assert_eq!(
        order,
        [0, 1, 2],
        "the stuck event still went first for its subject"
    );
    assert_eq!(w.epoch(durable).await, 2, "one leader, then one successor");
    b.shutdown().await;
    Failover {
        first,
        all,
        checkpoint: left,
        range,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_takeover_behind_a_stuck_message_starts_from_the_previous_leaders_checkpoint() {
    let failover =
        takeover_behind_a_stuck_message("STUCK_CHECKPOINT", 3_000, Scan::Checkpoint).await;
    eprintln!("{failover:?}");
    // Everything after the ack floor was handled except three: the
    // checkpoint lists them, and the new leader reads nothing else.
    assert_eq!(failover.range, (0, 3_003));
    assert_eq!(failover.checkpoint, Some((3_003, 3)));
    // 1.75 s for the dead leader's last pull, then a scan of three listed messages.
    assert!(failover.first < Duration::from_secs(5), "{failover:?}");
    // The stuck events come back after ack_wait (3 s).
    assert!(failover.all < Duration::from_secs(12), "{failover:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_takeover_behind_a_stuck_message_without_a_checkpoint_reads_the_stream_in_bulk() {
    let failover = takeover_behind_a_stuck_message("STUCK_FLOOR", 3_000, Scan::FromTheFloor).await;
    eprintln!("{failover:?}");
    assert!(failover.first < Duration::from_secs(8), "{failover:?}");
    assert!(failover.all < Duration::from_secs(15), "{failover:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_takeover_scan_that_hits_its_bound_holds_every_subject_until_redeliveries_settle() {
    let failover = takeover_behind_a_stuck_message("STUCK_BOUND", 2_000, Scan::Bounded).await;
    eprintln!("{failover:?}");
    // The stuck event, among the messages classified, goes first when it
    // comes back (after ack_wait, 3 s); everything else waits for the
    // backlog's deadline: 2 × 3 s + 10 s.
    assert!(failover.first < Duration::from_secs(10), "{failover:?}");
    assert!(failover.all > Duration::from_secs(15), "{failover:?}");
    assert!(failover.all < Duration::from_secs(30), "{failover:?}");
}

/// The measurement of BENCHMARKS.md ("Ordered takeover with a stuck
/// message"): 100,000 events handled behind one left unacked.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a measurement: 100,000 messages (about two minutes)"]
async fn takeover_behind_a_stuck_message_with_100k_messages_after_it() {
    let n = 100_000;
    let checkpoint = takeover_behind_a_stuck_message("STUCK_100K", n, Scan::Checkpoint).await;
    eprintln!("from the checkpoint: {checkpoint:?}");
    let floor = takeover_behind_a_stuck_message("STUCK_100K_FLOOR", n, Scan::FromTheFloor).await;
    eprintln!("from the ack floor, in bulk: {floor:?}");
    assert!(checkpoint.first < Duration::from_secs(5), "{checkpoint:?}");
    assert!(floor.first < Duration::from_secs(10), "{floor:?}");
}

/// What the scan before the checkpoint cost on its own: one stream request
/// per message between the ack floor and the last delivered message.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a measurement: 100,000 stream reads one at a time"]
async fn reading_100k_stream_messages_one_request_at_a_time() {
    let w = world("ONE_BY_ONE", &["o.>"]).await;
    let events: Vec<Envelope<Value>> = (0..100_000)
        .map(|i| {
            Envelope::new(
                "o.step",
                "tests",
                format!("sub_{}", i % 100),
                json!({"seq": i}),
            )
            .unwrap()
        })
        .collect();
    for chunk in events.chunks(1_000) {
        w.publish_all(chunk).await;
    }
    let stream = w.js.get_stream("ONE_BY_ONE").await.unwrap();
    let started = std::time::Instant::now();
    let mut ids = Vec::with_capacity(events.len());
    for sequence in 1..=100_000 {
        let message = stream.get_raw_message(sequence).await.unwrap();
        ids.push(Envelope::<Value>::from_json(&message.payload).unwrap().id());
    }
    eprintln!(
        "100,000 messages read one request at a time: {:?}",
        started.elapsed()
    );
    assert_eq!(ids.len(), events.len());
}
