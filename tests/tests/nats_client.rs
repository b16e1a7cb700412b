//! A NATS client closed under a running consumer or relay (drained, or its
//! connection task gone: what a fault in the client does) is a fault they
//! get out of, never a state they log for ever:
//!
//! - the library's `Consumer::run` (through the builder, ordered and not)
//!   and `Relay::run_jetstream`, whose client is the caller's, return
//!   `ErrorKind::ClientClosed` within seconds; run again on a new client,
//!   they carry on and nothing is lost or applied twice;
//! - the shipped `billing` (consumer and in-process relay) and `outbox-relay`
//!   build a new client from the same flags and carry on, as processes,
//!   saying so in their logs.
//!
//! The binaries are built by `scripts/test` before the tests run.

mod support;

use std::time::Duration;

use async_nats::jetstream;
use inbox_consumer::HandlerService;
use inbox_consumer::prelude::*;
use outbox_publisher::{Relay, RelayConfig, StreamSpec};
use outbox_testkit::{NatsServer, PgServer, Program, TestDb, wait_until};
use serde_json::json;
use sqlx::PgTransaction;
use support::{blocking, count};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(30);

/// Records each account once; a second apply of one event would fail on
/// the primary key, so "applied twice" cannot pass unseen.
#[derive(Clone)]
struct Open;

impl Handler for Open {
    type Message = serde_json::Value;

    async fn handle(
        &self,
        event: Envelope<serde_json::Value>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        sqlx::query("insert into accounts (id) values ($1)")
            .bind(event.id().to_string())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

async fn database() -> TestDb {
    let db = TestDb::new().await.unwrap();
    outbox_pg::migrate_with(&db.pool, "create table accounts (id text primary key)")
        .await
        .unwrap();
    db
}

/// `n` rows of `event_type` in the outbox, as a plain SQL writer adds them.
async fn write(db: &TestDb, event_type: &str, n: usize) {
    let rows: Vec<_> = (0..n)
        .map(|i| (Uuid::now_v7(), format!("acct-{}", i % 5), json!({ "n": i })))
        .collect();
    support::insert_events(&db.pool, event_type, &rows).await;
}

async fn closed_under_a_consumer(ordered: bool) {
    let db = database().await;
    let nats = outbox_testkit::nats().unwrap();
    let stream = if ordered {
        "CLOSED_ORD"
    } else {
        "CLOSED_UNORD"
    };
    let event_type = if ordered {
        "closedord.opened"
    } else {
        "closedun.opened"
    };
    let subjects = format!("{}.>", event_type.split('.').next().unwrap());

    // The relay runs on a client of its own, all along.
    let stop = CancellationToken::new();
    let relay = tokio::spawn(Relay::run_jetstream(
        db.pool.clone(),
        async_nats::connect(nats.url()).await.unwrap(),
        StreamSpec::new(stream, vec![subjects]),
        RelayConfig::default(),
        stop.clone().cancelled_owned(),
    ));
    let consume = |client: async_nats::Client| {
        tokio::spawn(
            Consumer::builder(db.pool.clone(), client, stream, "accounts")
                .route(event_type, HandlerService::new(Open))
                .configure(|c| c.ordered(ordered).ack_wait(Duration::from_secs(3)))
                .run(stop.clone().cancelled_owned()),
        )
    };

    let first = async_nats::connect(nats.url()).await.unwrap();
    let consumer = consume(first.clone());
    write(&db, event_type, 20).await;
    wait_until("the first 20 events applied", WAIT, || async {
        count(&db.pool, "select count(*) from accounts").await == 20
    })
    .await
    .unwrap();

    // The client goes away under the running consumer; events keep coming.
    first.drain().await.unwrap();
    write(&db, event_type, 20).await;
    let ended = tokio::time::timeout(WAIT, consumer)
        .await
        .expect("the consumer's run ended within 30 s of its client closing")
        .unwrap();
    let error = ended.expect_err("a closed client ends the run with an error");
    assert_eq!(
        error.kind(),
        inbox_consumer::ErrorKind::ClientClosed,
        "{error}"
    );
    assert!(error.to_string().contains("closed"), "{error}");

    // Not ready on the closed client; ready on a new one.
    let ready = |client: async_nats::Client| {
        inbox_consumer::Readiness::new(db.pool.clone(), client, stream, "accounts")
    };
    let closed = ready(first.clone()).check().await;
    assert!(!closed.is_ready(), "ready on a closed client: {closed:?}");
    let second = async_nats::connect(nats.url()).await.unwrap();
    let consumer = consume(second.clone());
    wait_until("ready on the new client", WAIT, || async {
        ready(second.clone()).check().await.is_ready()
    })
    .await
    .unwrap();

    // Run again on the new client: everything is applied, each event once.
    wait_until(
        "all 40 events applied after the new client",
        WAIT,
        || async { count(&db.pool, "select count(*) from accounts").await == 40 },
    )
    .await
    .unwrap();
    support::wait_acked(
        &jetstream::new(async_nats::connect(nats.url()).await.unwrap()),
        stream,
        "accounts",
        WAIT,
    )
    .await;
    assert_eq!(
        count(
            &db.pool,
            "select count(*) from inbox_events where consumer = 'accounts'"
        )
        .await,
        40
    );
    stop.cancel();
    consumer.await.unwrap().unwrap();
    relay.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_closed_under_an_unordered_consumer_ends_its_run_and_a_new_one_carries_on() {
    closed_under_a_consumer(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_closed_under_an_ordered_consumer_ends_its_run_and_a_new_one_carries_on() {
    closed_under_a_consumer(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_closed_under_a_running_relay_ends_its_run_and_a_new_one_carries_on() {
    let db = database().await;
    let nats = outbox_testkit::nats().unwrap();
    let stream = "CLOSED_RELAY";
    let relay = |client: async_nats::Client, stop: CancellationToken| {
        tokio::spawn(Relay::run_jetstream(
            db.pool.clone(),
            client,
            StreamSpec::new(stream, vec!["closedrelay.>".into()]),
            RelayConfig::default(),
            stop.cancelled_owned(),
        ))
    };
    let published = || async {
        count(
            &db.pool,
            "select count(*) from outbox_events where published_at is not null",
        )
        .await
    };

    let first = async_nats::connect(nats.url()).await.unwrap();
    let stop = CancellationToken::new();
    let running = relay(first.clone(), stop.clone());
    write(&db, "closedrelay.made", 20).await;
    wait_until("the first 20 rows published", WAIT, || async {
        published().await == 20
    })
    .await
    .unwrap();

    first.drain().await.unwrap();
    write(&db, "closedrelay.made", 20).await;
    let ended = tokio::time::timeout(WAIT, running)
        .await
        .expect("the relay's run ended within 30 s of its client closing")
        .unwrap();
    let error = ended.expect_err("a closed client ends the relay's run with an error");
    assert_eq!(
        error.kind(),
        outbox_publisher::ErrorKind::ClientClosed,
        "{error}"
    );
    assert_eq!(
        published().await,
        20,
        "nothing is marked without its PubAck"
    );

    // A client closed before the relay starts is refused at once, not waited on.
    let closed = async_nats::connect(nats.url()).await.unwrap();
    closed.drain().await.unwrap();
    wait_until("the drained client to close", WAIT, || async {
        outbox_pg::nats::is_closed(&closed)
    })
    .await
    .unwrap();
    let refused = tokio::time::timeout(WAIT, relay(closed, CancellationToken::new()))
        .await
        .expect("a relay given a closed client stops at once")
        .unwrap();
    assert_eq!(
        refused.unwrap_err().kind(),
        outbox_publisher::ErrorKind::ClientClosed
    );

    let stop = CancellationToken::new();
    let running = relay(async_nats::connect(nats.url()).await.unwrap(), stop.clone());
    wait_until("all 40 rows published on the new client", WAIT, || async {
        published().await == 40
    })
    .await
    .unwrap();
    assert_eq!(support::stream_count(nats.url(), stream).await, 40);
    stop.cancel();
    running.await.unwrap().unwrap();
}

/// Servers of the binaries' own, and a directory for their logs.
struct World {
    _pg: PgServer,
    db: TestDb,
    nats: NatsServer,
    log_dir: std::path::PathBuf,
}

async fn world(name: &str) -> World {
    let pg = blocking(PgServer::start).unwrap();
    let db = TestDb::on(&pg).await.unwrap();
    let nats = blocking(NatsServer::start).unwrap();
    let log_dir = std::env::temp_dir()
        .join("outbox-nats-client")
        .join(format!("{name}-{}", db.name()));
    std::fs::create_dir_all(&log_dir).unwrap();
    World {
        _pg: pg,
        db,
        nats,
        log_dir,
    }
}

impl World {
    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    fn program(&self, name: &str, binary: &str) -> Program {
        Program::new(name, support::bin_dir().join(binary), &self.log_dir)
            .env("DATABASE_URL", self.db.url())
            .env("NATS_URL", self.nats.url())
            .env("RUST_LOG", "info")
            .env("OUTBOX_TEST_CLOSE_NATS_AFTER", "3s")
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_relay_builds_a_new_client_when_its_client_is_closed_and_loses_nothing() {
    let world = world("relay").await;
    outbox_pg::migrate(&world.db.pool).await.unwrap();
    let mut relay =
        world
            .program("relay", "outbox-relay")
            .args(["--stream", "OUTBOX", "--subjects", "made.>"]);
    relay.start().await.unwrap();
    // Rows before, across and after the close.
    for _ in 0..10 {
        write(&world.db, "made.one", 10).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    wait_until("the relay to say it builds a new client", WAIT, || async {
        world
            .log("relay")
            .contains("building a new NATS client from the same flags")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", world.log("relay")));
    write(&world.db, "made.one", 10).await;
    wait_until("all 110 rows published", WAIT, || async {
        count(
            &world.db.pool,
            "select count(*) from outbox_events where published_at is not null",
        )
        .await
            == 110
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", world.log("relay")));
    assert_eq!(
        support::stream_count(&world.nats.url(), "OUTBOX").await,
        110
    );
    let log = world.log("relay");
    assert!(
        log.contains("the NATS client was closed under the relay"),
        "{log}"
    );
    assert!(relay.is_running(), "{log}");
    assert_eq!(relay.terminate().await, Some(0), "{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn billing_builds_a_new_client_when_its_client_is_closed_and_invoices_each_subscription_once()
{
    let world = world("billing").await;
    let js = support::billing_stream(&world.nats.url(), "OUTBOX").await;
    let mut billing = world
        .program("billing", "billing")
        .args(["--stream", "OUTBOX", "--consumer", "billing"])
        .ready_when("billing ready");
    billing.start().await.unwrap();
    let publish = |from: usize| {
        let js = js.clone();
        async move {
            for i in from..from + 10 {
                let id = Uuid::now_v7().to_string();
                let body = json!({
                    "specversion": "1.0", "id": id, "source": "subscriptions",
                    "type": "subscription.created", "subject": format!("sub-{i}"),
                    "time": "2026-12-01T00:00:00Z", "datacontenttype": "application/json",
                    "data": {"subscription_id": format!("sub-{i}"), "customer_id": "c1", "amount_cents": 1200},
                });
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", id.as_str());
                js.publish_with_headers(
                    "subscription.created",
                    headers,
                    serde_json::to_vec(&body).unwrap().into(),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            }
        }
    };
    // Events before, across and after the close.
    for round in 0..8 {
        publish(round * 10).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    wait_until("billing to say it builds a new client", WAIT, || async {
        world
            .log("billing")
            .contains("building a new NATS client from the same flags")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", world.log("billing")));
    publish(80).await;
    wait_until("90 invoices", Duration::from_secs(90), || async {
        count(&world.db.pool, "select count(*) from invoices").await == 90
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", world.log("billing")));
    assert_eq!(
        count(
            &world.db.pool,
            "select count(distinct subscription_id) from invoices"
        )
        .await,
        90
    );
    // The in-process relay, on the new client too, publishes billing's own
    // invoice.created events.
    wait_until("billing's 90 invoice events published", WAIT, || async {
        count(
            &world.db.pool,
            "select count(*) from outbox_events where published_at is not null",
        )
        .await
            == 90
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", world.log("billing")));
    let log = world.log("billing");
    assert!(
        log.contains("the NATS client was closed under the consumer"),
        "{log}"
    );
    assert!(billing.is_running(), "{log}");
    assert_eq!(billing.terminate().await, Some(0), "{log}");
}
