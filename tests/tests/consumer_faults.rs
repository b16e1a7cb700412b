//! The shipped `billing` consumer under faults, driven as an operator runs it:
//! billing is a child process, the events are hand-written CloudEvents JSON
//! published with a plain JetStream client (as a producer in any language
//! publishes them), and the outcome is read back from billing's tables and
//! from the durable consumer's state on the broker.
//!
//! - A database outage longer than the whole delivery budget loses nothing:
//!   every event published meanwhile ends as an invoice (or, for poison, a dead
//!   letter) once the database is back, and billing keeps running — ordered
//!   (the default) and unordered.
//! - Batched handling (`--batch 64`): one invoice per subscription through
//!   duplicates, a process killed between a batch's commit and its acks, and a
//!   cancellation whose handler fails until its creation is applied.
//! - What a process killed with SIGKILL held (running, and waiting for a
//!   slot) is handled by the next process within 5 s of the kill, with the
//!   default ack wait, ordered and unordered; held past the ack wait while
//!   the process lives, none of it is redelivered.
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

mod support;

use support::blocking;

use std::path::PathBuf;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use outbox_testkit::{NatsServer, PgServer, Program, TestDb, wait_until};
use serde_json::json;
use uuid::Uuid;

const STREAM: &str = "OUTBOX";
const DURABLE: &str = "billing";

/// Billing's own database server and broker, both restartable.
struct World {
    pg: PgServer,
    db: TestDb,
    nats: NatsServer,
    js: jetstream::Context,
    log_dir: PathBuf,
}

async fn world() -> World {
    let pg = blocking(PgServer::start).unwrap();
    let db = TestDb::on(&pg).await.unwrap();
    let nats = blocking(NatsServer::start).unwrap();
    let js = support::billing_stream(&nats.url(), STREAM).await;
    let log_dir = std::env::temp_dir()
        .join("outbox-consumer-faults")
        .join(db.name());
    std::fs::create_dir_all(&log_dir).unwrap();
    World {
        pg,
        db,
        nats,
        js,
        log_dir,
    }
}

impl Drop for World {
    /// Keeps billing's logs only when the test failed.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

impl World {
    /// `billing` on this world, its own outbox left unrelayed, with `extra`.
    fn billing(&self, name: &str, extra: &[&str]) -> Program {
        Program::new(name, support::bin_dir().join("billing"), &self.log_dir)
            .env("DATABASE_URL", self.db.url())
            .env("NATS_URL", self.nats.url())
            .args(["--stream", STREAM, "--consumer", DURABLE, "--no-relay"])
            .args(extra.iter().copied())
            .ready_when("billing ready")
    }

    async fn start(&self, name: &str, extra: &[&str]) -> Program {
        let mut billing = self.billing(name, extra);
        billing.start().await.unwrap();
        billing
    }

    /// Publishes many events at once, then waits for every ack.
    async fn publish_all(&self, events: &[Published]) {
        let mut acks = Vec::with_capacity(events.len());
        for (subject, body, msg_id) in events {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", msg_id.as_str());
            acks.push(
                self.js
                    .publish_with_headers(subject.clone(), headers, body.clone().into())
                    .await
                    .unwrap(),
            );
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }

    /// Deliveries the durable consumer has made so far (first and repeated).
    async fn delivered(&self) -> u64 {
        let mut consumer: jetstream::consumer::PullConsumer = self
            .js
            .get_stream(STREAM)
            .await
            .unwrap()
            .get_consumer(DURABLE)
            .await
            .unwrap();
        consumer.info().await.unwrap().delivered.consumer_sequence
    }

    /// Messages of the durable neither acked nor terminated yet.
    async fn outstanding(&self) -> u64 {
        let stream = self.js.get_stream(STREAM).await.unwrap();
        let info = stream.consumer_info(DURABLE).await.unwrap();
        info.num_pending + info.num_ack_pending as u64
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// Everything `name` logged so far.
    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// The end of `name`'s log, for a failure message.
    fn log_tail(&self, name: &str) -> String {
        support::log_tail(&self.log_dir.join(format!("{name}.log")))
    }

    fn assert_running(&self, billing: &mut Program) {
        let log = self.log_dir.join(format!("{}.log", billing.name));
        support::assert_running(billing, &log);
    }
}

/// A message to publish: its subject, its bytes and its `Nats-Msg-Id`.
type Published = (String, Vec<u8>, String);

/// An event as another language's producer writes it, published with its
/// id as the message id.
fn event(event_type: &str, subscription: &str, time: &str, data: serde_json::Value) -> Published {
    let id = Uuid::now_v7().to_string();
    let body = json!({
        "specversion": "1.0",
        "id": id,
        "source": "subscriptions",
        "type": event_type,
        "subject": subscription,
        "time": time,
        "datacontenttype": "application/json",
        "data": data,
    });
    (
        event_type.to_owned(),
        serde_json::to_vec(&body).unwrap(),
        id,
    )
}

/// A `subscription.created`.
fn created(subscription: &str) -> Published {
    let data = json!({"subscription_id": subscription, "customer_id": "c1", "amount_cents": 1200});
    event(
        "subscription.created",
        subscription,
        "2026-12-01T00:00:00Z",
        data,
    )
}

/// A `subscription.cancelled`.
fn cancelled(subscription: &str) -> Published {
    let data = json!({"subscription_id": subscription});
    event(
        "subscription.cancelled",
        subscription,
        "2026-12-01T00:00:01Z",
        data,
    )
}

// ---------------------------------------------------------------------------
// 1. A database outage longer than the delivery budget.

/// `--max-deliver 3 --ack-wait 2s` with the default retry delays (1 s, 2 s):
/// the whole budget of one message is spent in about 6 s.
const BUDGET_FLAGS: [&str; 4] = ["--max-deliver", "3", "--ack-wait", "2s"];

async fn an_outage_longer_than_the_budget(ordered: bool) {
    let mut w = world().await;
    let mut flags: Vec<&str> = BUDGET_FLAGS.to_vec();
    if !ordered {
        flags.push("--unordered");
    }
    let mut billing = w.start("billing", &flags).await;

    let warm_up: Vec<_> = (0..3).map(|i| created(&format!("warm-{i}"))).collect();
    w.publish_all(&warm_up).await;
    wait_until("3 warm-up invoices", Duration::from_secs(60), || async {
        w.scalar("select count(*) from invoices").await == 3
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", w.log_tail("billing")));

    let before = w.delivered().await;
    blocking(|| w.pg.stop()).unwrap();
    let mut during: Vec<_> = (0..5).map(|i| created(&format!("outage-{i}"))).collect();
    // Poison too: its dead letter cannot be written while the database is down.
    during.push((
        "subscription.created".to_owned(),
        b"\x00 not json".to_vec(),
        "poison-1".to_owned(),
    ));
    w.publish_all(&during).await;
    if ordered {
        // The leader's session is gone with the database: nobody pulls. The
        // outage outlasts the budget's 6 s by far.
        tokio::time::sleep(Duration::from_secs(12)).await;
    } else {
        // Every message delivered past its budget of 3 while the database is down.
        let past_budget = before + 6 * 4;
        wait_until(
            "each message delivered 4 times during the outage",
            Duration::from_secs(90),
            || async { w.delivered().await >= past_budget },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", w.log_tail("billing")));
    }
    w.assert_running(&mut billing);
    blocking(|| w.pg.start_again()).unwrap();

    wait_until(
        "8 invoices, the poison dead-lettered, nothing outstanding",
        Duration::from_secs(120),
        || async {
            w.scalar("select count(*) from invoices").await == 8
                && w.scalar("select count(*) from inbox_dead_letters").await == 1
                && w.outstanding().await == 0
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", w.log_tail("billing")));
    w.assert_running(&mut billing);
    assert_eq!(
        w.scalar("select count(distinct subscription_id) from invoices")
            .await,
        8
    );
    let reason: String = sqlx::query_scalar("select reason from inbox_dead_letters")
        .fetch_one(&w.db.pool)
        .await
        .unwrap();
    assert_eq!(reason, "not_json");
    billing.terminate().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_database_outage_longer_than_the_delivery_budget_loses_nothing_ordered() {
    an_outage_longer_than_the_budget(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_database_outage_longer_than_the_delivery_budget_loses_nothing_unordered() {
    an_outage_longer_than_the_budget(false).await;
}

// ---------------------------------------------------------------------------
// 2. Batched handling.

#[tokio::test(flavor = "multi_thread")]
async fn batches_make_one_invoice_per_subscription_through_duplicates_a_crash_and_a_retry() {
    const SUBSCRIPTIONS: usize = 1_000;
    let w = world().await;
    let mut events = Vec::new();
    // A cancellation ahead of its creation: its handler fails until the
    // creation is applied (then it voids the invoice).
    let late = "sub-late";
    events.push(cancelled(late));
    let creations: Vec<Published> = (0..SUBSCRIPTIONS)
        .map(|i| created(&format!("sub-{i:04}")))
        .collect();
    // 200 copies re-sent with new message ids: the broker stores them again.
    let copies: Vec<Published> = creations
        .iter()
        .step_by(5)
        .map(|(subject, body, id)| (subject.clone(), body.clone(), format!("{id}-again")))
        .collect();
    events.extend(creations);
    events.extend(copies);
    events.push(created(late));
    w.publish_all(&events).await;

    let batch = ["--batch", "64", "--concurrency", "4", "--unordered"];
    // The first process aborts right after its first committed batch, before
    // that batch's acks.
    let mut first = w
        .start(
            "billing-crashing",
            &[&batch[..], &["--crash-after-commit", "1"]].concat(),
        )
        .await;
    wait_until(
        "the first process aborts after a commit",
        Duration::from_secs(60),
        || {
            let died = first.died();
            async move { died }
        },
    )
    .await
    .unwrap();
    let committed_before_crash = w.scalar("select count(*) from invoices").await;
    assert!(committed_before_crash > 0, "the crash followed a commit");

    let mut billing = w.start("billing", &batch).await;
    wait_until(
        "every subscription invoiced once, the late one voided, nothing outstanding",
        Duration::from_secs(120),
        || async {
            w.scalar("select count(*) from invoices").await == SUBSCRIPTIONS as i64 + 1
                && w.scalar("select count(*) from invoices where voided_at is not null")
                    .await
                    == 1
                && w.outstanding().await == 0
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", w.log_tail("billing")));
    w.assert_running(&mut billing);
    assert_eq!(
        w.scalar("select count(distinct subscription_id) from invoices")
            .await,
        SUBSCRIPTIONS as i64 + 1,
        "one invoice per subscription"
    );
    assert_eq!(
        w.scalar(
            "select count(*) from invoices where subscription_id = 'sub-late' and voided_at is not null"
        )
        .await,
        1
    );
    assert_eq!(w.scalar("select count(*) from inbox_dead_letters").await, 0);
    // Everything the crashed process committed came back and was a duplicate.
    assert_eq!(
        w.scalar("select count(*) from inbox_events where consumer = 'billing'")
            .await,
        SUBSCRIPTIONS as i64 + 2
    );
    billing.terminate().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ordered_batches_void_every_invoice_in_order_through_a_leader_killed_mid_stream() {
    const SUBSCRIPTIONS: usize = 1_000;
    let w = world().await;
    let flags = ["--batch", "64", "--ack-wait", "3s", "--lease-timeout", "6s"];
    let mut a = w.start("billing-a", &flags).await;
    let mut b = w.start("billing-b", &flags).await;

    let mut events = Vec::with_capacity(2 * SUBSCRIPTIONS);
    for i in 0..SUBSCRIPTIONS {
        let subscription = format!("sub-{i:04}");
        events.push(created(&subscription));
        events.push(cancelled(&subscription));
    }
    w.publish_all(&events).await;

    wait_until("a third invoiced", Duration::from_secs(60), || async {
        w.scalar("select count(*) from invoices").await >= (SUBSCRIPTIONS / 3) as i64
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", w.log_tail("billing-a")));
    let leads = |name: &str| w.log(name).contains("this replica leads");
    let (leader, survivor) = if leads("billing-a") {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    leader.kill9().await;

    wait_until(
        "every invoice voided, nothing outstanding",
        Duration::from_secs(120),
        || async {
            w.scalar("select count(*) from invoices where voided_at is not null")
                .await
                == SUBSCRIPTIONS as i64
                && w.outstanding().await == 0
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", w.log_tail(&survivor.name)));
    w.assert_running(survivor);
    assert_eq!(
        w.scalar("select count(*) from invoices").await,
        SUBSCRIPTIONS as i64,
        "one invoice per subscription"
    );
    assert_eq!(
        w.scalar("select count(distinct subscription_id) from invoices")
            .await,
        SUBSCRIPTIONS as i64
    );
    assert_eq!(w.scalar("select count(*) from inbox_dead_letters").await, 0);
    survivor.terminate().await;
}

// ---------------------------------------------------------------------------
// 3. The durable deleted and the inbox rows pruned past retention.

/// Billing killed after handling 50 events, its inbox rows aged past the
/// 14-day window and deleted as retention deletes them, the durable removed
/// by an operator, billing started again: the new durable starts after the
/// recorded ack floor, so no subscription is invoiced twice. A deployment
/// under a new durable name reads on from there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_deleted_after_retention_invoices_nothing_twice() {
    let w = world().await;
    let mut billing = w.start("billing", &[]).await;
    let first: Vec<_> = (0..50).map(|i| created(&format!("sub-{i}"))).collect();
    w.publish_all(&first).await;
    wait_until("50 invoices", Duration::from_secs(60), || async {
        w.scalar("select count(*) from invoices").await == 50
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; billing's log:\n{}", w.log_tail("billing")));
    wait_until(
        "the ack floor recorded",
        Duration::from_secs(10),
        || async {
            w.scalar("select ack_floor from inbox_consumers where consumer = 'billing'")
                .await
                >= 50
        },
    )
    .await
    .unwrap();
    billing.kill9().await;

    sqlx::raw_sql(
        "update inbox_events set handled_at = handled_at - interval '15 days';
         delete from inbox_events where handled_at < now() - interval '14 days';",
    )
    .execute(&w.db.pool)
    .await
    .unwrap();
    assert_eq!(w.scalar("select count(*) from inbox_events").await, 0);
    w.js.get_stream(STREAM)
        .await
        .unwrap()
        .delete_consumer(DURABLE)
        .await
        .unwrap();

    let mut billing = w.start("billing-again", &[]).await;
    w.publish_all(&[created("sub-50")]).await;
    wait_until(
        "the new event invoiced",
        Duration::from_secs(60),
        || async {
            w.scalar("select count(*) from invoices where subscription_id = 'sub-50'")
                .await
                == 1
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}; billing's log:\n{}", w.log_tail("billing-again")));
    wait_until("every message settled", Duration::from_secs(30), || async {
        w.outstanding().await == 0
    })
    .await
    .unwrap();
    w.assert_running(&mut billing);
    assert_eq!(
        w.scalar("select count(*) from invoices").await,
        51,
        "one invoice per subscription; billing's log:\n{}",
        w.log_tail("billing-again")
    );
    assert_eq!(
        w.scalar("select count(distinct subscription_id) from invoices")
            .await,
        51
    );
    assert!(
        w.log("billing-again")
            .contains("after its recorded ack floor"),
        "billing says where the durable starts:\n{}",
        w.log_tail("billing-again")
    );
    billing.terminate().await;
}

// ---------------------------------------------------------------------------
// 4. What a killed process held comes back within seconds.

/// The bound, from the kill of the process that held the events to every one
/// of them handled by the process started in its place.
const HELD_BACK_WITHIN: Duration = Duration::from_secs(5);

/// Billing (default ack wait, `extra`) holds 20 creations: the test holds an
/// exclusive lock on `invoices`, so each handler waits on it (16 running, the
/// others waiting for a slot). Held past the ack wait with no redelivery (the
/// in-progress acks keep them), billing is killed with SIGKILL, the lock is
/// let go and another billing started at once: every event is invoiced
/// within [`HELD_BACK_WITHIN`] of the kill, once.
async fn held_events_come_back_within_seconds(extra: &[&str]) {
    const EVENTS: usize = 20;
    let w = world().await;
    let mut first = w.start("billing-held", extra).await;
    let mut lock = w.db.pool.begin().await.unwrap();
    sqlx::query("lock table invoices in exclusive mode")
        .execute(&mut *lock)
        .await
        .unwrap();
    let events: Vec<Published> = (0..EVENTS)
        .map(|i| created(&format!("sub-{i:02}")))
        .collect();
    w.publish_all(&events).await;
    let stream = w.js.get_stream(STREAM).await.unwrap();
    wait_until(
        "billing holds every event",
        Duration::from_secs(30),
        || async {
            let info = stream.consumer_info(DURABLE).await.unwrap();
            info.num_ack_pending == EVENTS && info.num_pending == 0
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", w.log_tail("billing-held")));
    let info = stream.consumer_info(DURABLE).await.unwrap();
    let ack_wait = info.config.ack_wait;
    assert!(
        ack_wait <= Duration::from_secs(4),
        "billing's default ack wait is short: {ack_wait:?}"
    );
    // Held past the ack wait (within the 5 s lock timeout, after which an
    // unordered billing would nak): nothing comes back while billing lives.
    tokio::time::sleep(ack_wait + Duration::from_millis(500)).await;
    let info = stream.consumer_info(DURABLE).await.unwrap();
    assert_eq!(
        (info.num_redelivered, info.delivered.consumer_sequence),
        (0, EVENTS as u64),
        "billing kept what it held, undelivered elsewhere and not redelivered"
    );
    w.assert_running(&mut first);

    first.kill9().await;
    let killed = std::time::Instant::now();
    lock.rollback().await.unwrap();
    let mut second = w.start("billing-after", extra).await;
    let started = killed.elapsed();
    wait_until(
        "every held event invoiced",
        Duration::from_secs(60),
        || async { w.scalar("select count(*) from invoices").await == EVENTS as i64 },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", w.log_tail("billing-after")));
    let handled = killed.elapsed();
    println!(
        "held events after a kill -9 ({extra:?}): ack wait {ack_wait:?}, the new billing ready \
         after {started:?}, every event invoiced after {handled:?}"
    );
    assert!(
        handled <= HELD_BACK_WITHIN,
        "every held event handled {handled:?} after the kill (ready after {started:?}); \
         billing's log:\n{}",
        w.log_tail("billing-after")
    );
    wait_until("every message settled", Duration::from_secs(30), || async {
        w.outstanding().await == 0
    })
    .await
    .unwrap();
    assert_eq!(
        w.scalar("select count(distinct subscription_id) from invoices")
            .await,
        EVENTS as i64,
        "one invoice per subscription"
    );
    w.assert_running(&mut second);
    second.terminate().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn what_a_killed_leader_held_is_handled_within_seconds() {
    held_events_come_back_within_seconds(&[]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn what_a_killed_unordered_replica_held_is_handled_within_seconds() {
    held_events_come_back_within_seconds(&["--unordered"]).await;
}
