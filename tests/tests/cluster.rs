//! A 3-node JetStream cluster ([`NatsCluster`]) with an R3 stream, against
//! real nats-servers and PostgreSQL:
//!
//! - the harness: three nodes, one meta leader, an R3 stream led by one node;
//!   `kill -9` of a follower and then of the stream leader leave the stream
//!   writable (a new leader is elected) and every acknowledged message kept;
//!   restarted nodes rejoin and catch up; a client given every node's URL
//!   connects while the first node is down;
//! - `outbox-relay --stream-replicas 3` refuses an R1 stream, naming both;
//! - `outbox-relay` whose node is killed -9 reconnects to another node (from
//!   the URL list) and publishes what was written meanwhile, each event once;
//! - `outbox-relay` and `billing` as processes, given every node's URL, ride
//!   through a stream-leader kill: N events, N invoices, N inbox rows, no
//!   dead letter, nothing unpublished;
//! - the chaos run (`outbox-demo --chaos --cluster`): a non-leader node
//!   killed -9 and restarted, then the stream leader, under load and the
//!   other faults: 0 lost, 0 applied twice, 0 order violations, checked from
//!   the databases and the stream.
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

mod support;

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream::StorageType};
use outbox_pg::connect::NatsArgs;
use outbox_testkit::{NatsCluster, wait_until};

const WAIT: Duration = Duration::from_secs(60);

/// A JetStream context on every node of `cluster`.
async fn js(cluster: &NatsCluster) -> jetstream::Context {
    let client = NatsArgs::new(cluster.url())
        .connect("cluster-test")
        .await
        .unwrap();
    jetstream::new(client)
}

fn r3(name: &str, subjects: &[&str]) -> jetstream::stream::Config {
    jetstream::stream::Config {
        name: name.to_owned(),
        subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
        storage: StorageType::File,
        num_replicas: 3,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    }
}

/// Publishes `subject` with message id `id` until a PubAck comes back
/// (during an election a publish times out or finds no responders), for at
/// most [`WAIT`]; returns the stream sequence.
async fn publish_acked(js: &jetstream::Context, subject: &str, id: &str) -> u64 {
    let deadline = Instant::now() + WAIT;
    loop {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        let attempt = async {
            js.publish_with_headers(subject.to_owned(), headers, id.to_owned().into())
                .await?
                .await
                .map_err(async_nats::Error::from)
        };
        match tokio::time::timeout(Duration::from_secs(3), attempt).await {
            Ok(Ok(ack)) => return ack.sequence,
            Ok(Err(e)) => assert!(Instant::now() < deadline, "publishing {id}: {e}"),
            Err(_) => assert!(Instant::now() < deadline, "publishing {id}: timed out"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Creates a stream, trying again while the cluster has no meta leader yet
/// (right after it starts, on a loaded machine, the request times out), for
/// at most [`WAIT`].
async fn create_stream(js: &jetstream::Context, config: jetstream::stream::Config) {
    let deadline = Instant::now() + WAIT;
    loop {
        match js.create_stream(config.clone()).await {
            Ok(_) => return,
            Err(e) => assert!(
                Instant::now() < deadline,
                "creating stream {}: {e}",
                config.name
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn stored(js: &jetstream::Context, stream: &str) -> u64 {
    let mut s = js.get_stream(stream).await.unwrap();
    s.info().await.unwrap().state.messages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_keeps_an_r3_stream_writable_through_a_follower_kill_and_a_leader_kill() {
    let mut cluster = NatsCluster::start().await.unwrap();
    assert_eq!(cluster.len(), 3);
    assert_eq!(cluster.url().split(',').count(), 3);
    assert!(cluster.url().contains(&cluster.node_url(2).unwrap()));
    let js = js(&cluster).await;
    create_stream(&js, r3("HARNESS", &["harness.>"])).await;
    let leader = cluster.stream_leader(&js, "HARNESS", WAIT).await.unwrap();
    let info = js
        .get_stream("HARNESS")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(info.config.num_replicas, 3);
    assert_eq!(
        info.cluster.as_ref().unwrap().replicas.len(),
        2,
        "two followers beside the leader: {:?}",
        info.cluster
    );
    for i in 0..10 {
        publish_acked(&js, "harness.a", &format!("before-{i}")).await;
    }

    // A follower dies: the leader and the other follower are a quorum.
    let follower = (leader + 1) % 3;
    tokio::task::block_in_place(|| cluster.kill(follower)).unwrap();
    for i in 0..10 {
        publish_acked(&js, "harness.a", &format!("follower-down-{i}")).await;
    }
    tokio::task::block_in_place(|| cluster.restart(follower)).unwrap();
    cluster.wait_healthy(WAIT).await.unwrap();

    // The leader dies: the followers elect one of themselves.
    tokio::task::block_in_place(|| cluster.kill(leader)).unwrap();
    for i in 0..10 {
        publish_acked(&js, "harness.a", &format!("leader-down-{i}")).await;
    }
    let new_leader = cluster.stream_leader(&js, "HARNESS", WAIT).await.unwrap();
    assert_ne!(new_leader, leader, "a dead node leads nothing");
    assert_eq!(stored(&js, "HARNESS").await, 30, "every acked message kept");
    // A republish of an acked id is still a duplicate on the new leader.
    let before = stored(&js, "HARNESS").await;
    publish_acked(&js, "harness.a", "before-3").await;
    assert_eq!(stored(&js, "HARNESS").await, before);

    tokio::task::block_in_place(|| cluster.restart(leader)).unwrap();
    cluster.wait_healthy(WAIT).await.unwrap();

    // A client given every URL connects with the first node down.
    tokio::task::block_in_place(|| cluster.kill(0)).unwrap();
    let args = NatsArgs::new(format!(
        "{} , {},{}",
        cluster.node_url(0).unwrap(),
        cluster.node_url(1).unwrap(),
        cluster.node_url(2).unwrap()
    ));
    let client = tokio::time::timeout(WAIT, args.connect("list-test"))
        .await
        .unwrap()
        .unwrap();
    wait_until("a connection to a live node", WAIT, || async {
        client.connection_state() == async_nats::connection::State::Connected
    })
    .await
    .unwrap();
    let js2 = jetstream::new(client);
    publish_acked(&js2, "harness.a", "first-node-down").await;
    assert_eq!(stored(&js2, "HARNESS").await, 31);
}

/// An R1 stream on the cluster and a relay that demands R3: refused at
/// start, naming the stream's replicas and the configured ones; the same
/// relay demanding 1 replica starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_demanding_three_replicas_refuses_an_r1_stream() {
    let cluster = NatsCluster::start().await.unwrap();
    let js = js(&cluster).await;
    let mut config = r3("SINGLE", &["single.>"]);
    config.num_replicas = 1;
    create_stream(&js, config).await;
    let db = outbox_testkit::TestDb::new().await.unwrap();
    let relay = |replicas: &str| {
        let mut cmd = tokio::process::Command::new(support::bin_dir().join("outbox-relay"));
        cmd.env_clear()
            .env("DATABASE_URL", db.url())
            .env("NATS_URL", cluster.url())
            .args(["--stream", "SINGLE", "--subjects", "single.>"])
            .args(["--stream-replicas", replicas, "--once"])
            .kill_on_drop(true);
        cmd
    };
    let out = tokio::time::timeout(WAIT, relay("3").output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an R1 stream accepted:\n{stderr}");
    assert!(
        stderr.contains("replicas are 1, configured 3") && stderr.contains("SINGLE"),
        "{stderr}"
    );
    let out = tokio::time::timeout(WAIT, relay("1").output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `outbox-relay` given every node's URL: the node it is connected to is
/// killed -9, and it reconnects to another and publishes what was written
/// meanwhile, each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_moves_to_another_node_when_its_own_dies() {
    const STREAM: &str = "MOVES";
    let mut cluster = NatsCluster::start().await.unwrap();
    let js = js(&cluster).await;
    create_stream(&js, r3(STREAM, &["moves.>"])).await;
    let db = outbox_testkit::TestDb::new().await.unwrap();
    let log_dir = tempfile::tempdir().unwrap();
    let mut relay = outbox_testkit::Program::new(
        "relay",
        support::bin_dir().join("outbox-relay"),
        log_dir.path(),
    )
    .env("DATABASE_URL", db.url())
    .env("NATS_URL", cluster.url())
    .args(["--stream", STREAM, "--stream-replicas", "3"])
    .args(["--poll-interval", "100ms", "--publish-timeout", "2s"])
    .args(["--backoff-base", "100ms", "--max-backoff", "1s"]);
    relay.start().await.unwrap();
    let deadline = Instant::now() + WAIT;
    let first = loop {
        if let Some(node) = cluster.client_node("outbox-relay").await.unwrap() {
            break node;
        }
        assert!(Instant::now() < deadline, "the relay connected to no node");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::task::block_in_place(|| cluster.kill(first)).unwrap();

    let outbox = outbox_pg::Outbox::unvalidated();
    let envelopes: Vec<outbox_pg::Envelope> = (0..20)
        .map(|i| {
            outbox_pg::Envelope::new(
                "moves.created",
                "cluster-test",
                format!("entity_{}", i % 3),
                serde_json::json!({ "n": i }),
            )
            .unwrap()
        })
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    outbox.enqueue_all(&mut tx, &envelopes).await.unwrap();
    tx.commit().await.unwrap();
    let published = wait_until("the events published after the kill", WAIT, || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from outbox_events where published_at is null",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
            == 0
    })
    .await;
    if let Err(e) = published {
        panic!(
            "{e}:\n{}",
            std::fs::read_to_string(log_dir.path().join("relay.log")).unwrap_or_default()
        );
    }
    let now = cluster.client_node("outbox-relay").await.unwrap();
    assert!(
        now.is_some_and(|n| n != first),
        "connected to {now:?}, killed {first}"
    );
    assert_eq!(stored(&js, STREAM).await, 20, "each event once");
    tokio::task::block_in_place(|| cluster.restart(first)).unwrap();
    cluster.wait_healthy(WAIT).await.unwrap();
    assert_eq!(relay.terminate().await, Some(0));
}

/// `outbox-relay` and `billing` as processes, given every node's URL, with an
/// R3 stream: the stream's leader is killed -9 while events flow; every
/// event is published once in the stream (by message id), billing raises
/// exactly one invoice per subscription and one inbox row per event, no dead
/// letter, nothing left unpublished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_and_billing_ride_through_a_stream_leader_kill_exactly_once() {
    const N: i64 = 150;
    const STREAM: &str = "OUTBOX";
    let mut cluster = NatsCluster::start().await.unwrap();
    let js = js(&cluster).await;
    let subs = outbox_testkit::TestDb::new().await.unwrap();
    let billing_db = outbox_testkit::TestDb::new().await.unwrap();
    example_subscriptions::migrate(&subs.pool).await.unwrap();
    let log_dir = tempfile::tempdir().unwrap();
    let bin = support::bin_dir();
    let mut relay = outbox_testkit::Program::new("relay", bin.join("outbox-relay"), log_dir.path())
        .env("DATABASE_URL", subs.url())
        .env("NATS_URL", cluster.url())
        .args(["--stream", STREAM, "--subjects", "subscription.>,invoice.>"])
        .args(["--stream-replicas", "3", "--stream-storage", "file"])
        .args(["--poll-interval", "100ms", "--publish-timeout", "2s"])
        .args(["--backoff-base", "100ms", "--max-backoff", "1s"]);
    relay.start().await.unwrap();
    wait_until("the relay's R3 stream", WAIT, || async {
        js.get_stream(STREAM).await.is_ok()
    })
    .await
    .unwrap();
    let mut billing = outbox_testkit::Program::new("billing", bin.join("billing"), log_dir.path())
        .env("DATABASE_URL", billing_db.url())
        .env("NATS_URL", cluster.url())
        .args([
            "--consumer",
            "billing",
            "--stream",
            STREAM,
            "--ack-wait",
            "5s",
        ])
        .ready_when("billing ready");
    billing.start().await.unwrap();
    // Billing's durable inherits the stream's three replicas.
    let mut durable: jetstream::consumer::PullConsumer = js
        .get_consumer_from_stream("billing", STREAM)
        .await
        .unwrap();
    let durable = durable.info().await.unwrap();
    assert_eq!(
        durable.cluster.as_ref().map(|c| c.replicas.len()),
        Some(2),
        "the durable's leader and two followers: {:?}",
        durable.cluster
    );

    let schemas =
        outbox_pg::SchemaRegistry::from_dir(example_subscriptions::default_schemas_dir()).unwrap();
    let app = example_subscriptions::router(example_subscriptions::AppState::new(
        subs.pool.clone(),
        outbox_pg::Outbox::new(schemas),
    ));
    let count = |pool: &sqlx::PgPool, sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap_or(-1)
        }
    };
    let traffic = tokio::spawn(async move {
        use tower::ServiceExt as _;
        for i in 0..N {
            let body = serde_json::json!({
                "customer_id": format!("cus_{}", i % 13),
                "plan": "pro",
                "amount_cents": 100 + i,
            });
            let request = axum::http::Request::post("/v1/subscriptions")
                .header("content-type", "application/json")
                .body(axum::body::Body::from(body.to_string()))
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), axum::http::StatusCode::CREATED);
            tokio::time::sleep(Duration::from_millis(15)).await; // pacing, not waiting
        }
    });

    wait_until("invoices under way", WAIT, || async {
        count(&billing_db.pool, "select count(*) from invoices").await >= N / 4
    })
    .await
    .unwrap();
    let leader = cluster.stream_leader(&js, STREAM, WAIT).await.unwrap();
    tokio::task::block_in_place(|| cluster.kill(leader)).unwrap();
    let at_kill = count(&billing_db.pool, "select count(*) from invoices").await;
    let new_leader = cluster.stream_leader(&js, STREAM, WAIT).await.unwrap();
    assert_ne!(new_leader, leader);
    wait_until("invoices after the leader's death", WAIT, || async {
        count(&billing_db.pool, "select count(*) from invoices").await > at_kill
    })
    .await
    .unwrap();
    traffic.await.unwrap();
    let outcome = wait_until("every subscription invoiced and relayed", WAIT, || async {
        count(&billing_db.pool, "select count(*) from invoices").await >= N
            && count(
                &subs.pool,
                "select count(*) from outbox_events where published_at is null",
            )
            .await
                == 0
    })
    .await;
    if let Err(e) = outcome {
        for p in [&relay, &billing] {
            eprintln!(
                "--- {}:\n{}",
                p.name,
                std::fs::read_to_string(log_dir.path().join(format!("{}.log", p.name)))
                    .unwrap_or_default()
            );
        }
        panic!("{e}");
    }
    tokio::task::block_in_place(|| cluster.restart(leader)).unwrap();
    cluster.wait_healthy(WAIT).await.unwrap();

    assert_eq!(
        count(&billing_db.pool, "select count(*) from invoices").await,
        N,
        "exactly one invoice per subscription"
    );
    assert_eq!(
        count(
            &billing_db.pool,
            "select count(distinct subscription_id) from invoices"
        )
        .await,
        N
    );
    assert_eq!(
        count(
            &billing_db.pool,
            "select count(*) from inbox_events where consumer = 'billing'"
        )
        .await,
        N,
        "one inbox row per event"
    );
    assert_eq!(
        count(&billing_db.pool, "select count(*) from inbox_dead_letters").await,
        0,
        "no dead letter"
    );
    // Every event is in the stream once (the duplicate window drops a
    // republish whose PubAck was lost in the election).
    let ids: Vec<uuid::Uuid> = sqlx::query_scalar("select id from outbox_events")
        .fetch_all(&subs.pool)
        .await
        .unwrap();
    assert_eq!(ids.len() as i64, N);
    let mut stream = js.get_stream(STREAM).await.unwrap();
    let mut in_stream = std::collections::BTreeMap::<String, u32>::new();
    let last = stream.info().await.unwrap().state.last_sequence;
    for seq in 1..=last {
        if let Ok(msg) = stream.get_raw_message(seq).await
            && msg.subject.starts_with("subscription.")
            && let Some(id) = msg.headers.get("Nats-Msg-Id")
        {
            *in_stream.entry(id.to_string()).or_default() += 1;
        }
    }
    for id in &ids {
        assert_eq!(
            in_stream.get(&id.to_string()).copied(),
            Some(1),
            "event {id} in the stream once"
        );
    }
    assert_eq!(billing.terminate().await, Some(0));
    assert_eq!(relay.terminate().await, Some(0));
}

/// The chaos run on a 3-node cluster with an R3 stream: `outbox-demo
/// --chaos --cluster` kills -9 a node that does not lead the stream and
/// restarts it, then the stream leader, while the load, relay and billing
/// kills and billing deaths between commit and ack go on; the demo's checker
/// reads the databases and the stream.
#[test]
fn a_seeded_chaos_run_on_a_cluster_keeps_every_invariant() {
    let out = support::demo(&[
        "--chaos",
        "--cluster",
        "--duration",
        "30",
        "--seed",
        "42",
        "--fault-interval",
        "5",
        "--crash-rate",
        "0.005",
        "--settle-timeout",
        "90",
    ]);
    assert!(
        out.status.success() && out.stdout.contains("RESULT: PASS"),
        "chaos run failed ({:?}):\n{}\n{}",
        out.status,
        out.stdout,
        out.stderr
    );
    for fault in [
        "(not the stream leader)",
        "(the stream leader)",
        "fault: restarting nats node",
        "fault: kill -9 relay",
        "fault: kill -9 billing",
    ] {
        assert!(
            out.stdout.contains(fault),
            "the schedule never injected `{fault}`:\n{}",
            out.stdout
        );
    }
    for invariant in [
        "lost                          0  ok",
        "applied twice                 0  ok",
        "order violations              0  ok",
    ] {
        assert!(out.stdout.contains(invariant), "{}", out.stdout);
    }
}
