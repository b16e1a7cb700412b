//! The audit against a real nats-server that loses messages it acknowledged:
//! the real `outbox-relay` publishes events (acked, each row marked with its
//! stream and sequence), the stream then loses some of them, and the relay's
//! audit finds each lost one, makes its row unpublished again and publishes it
//! again under the same id, once; a consumer applies every event exactly once.
//!
//! - **Deleted messages** (`stream.delete_message(seq)`): half of the events'
//!   messages are deleted. The consumer is started only after the loss, as a
//!   consumer that had not read them yet when the broker lost them (the case
//!   where the loss matters: nothing downstream would ever see these events);
//!   it applies all of them once, the lost ones from their republished copy.
//!   The other half (intact) is a control group: never republished, rows
//!   untouched. The counter (`outbox_relay_audit_republished_total`) and the warn
//!   lines count each lost row once, also after the republished rows have
//!   been audited in turn; the stream holds each id once again.
//! - **A store lost in a restart**: nats-server stopped, the stream's message
//!   files removed, started again: the stream is empty and hands the lost
//!   sequences out again, to later events. The audit tells them apart by
//!   message id (3 rows find another event's message at their sequence, the
//!   others none) and republishes each lost row once; the later events, at
//!   the reused sequences, are left alone.
//! - **The broker down during a pass**: nothing is republished, rows keep
//!   their positions; the pass succeeds once the broker is back.
//! - **`outboxctl audit`** reports missing rows (JSON), and with
//!   `--republish` hands them to the running relay.
//! - **A custom `Sink` without stream positions** still publishes: its rows
//!   are marked without one and not audited.
//! - **The dedupe map**, which the audit's wait past the duplicate window
//!   rests on: after a delete or a purge, a publish of the same id within the
//!   window is acked as a duplicate (the old sequence) and not stored; after a
//!   restart that lost the store the id is forgotten.
//!
//! The test stream has a 5 s duplicate window (lease 2 s + publish timeout
//! 1 s must fit in it), so a row is audited 6.25 s after it was published.
//! The binaries are built by `scripts/test` before the tests run.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use inbox_consumer::prelude::*;
use outbox_pg::{Envelope, Outbox};
use outbox_testkit::{NatsServer, Program, TestDb, wait_until};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgTransaction;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);
const LOST_LINE: &str = "the stream lost an acknowledged message";

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
struct Item {
    n: i64,
}

impl Event for Item {
    const TYPE: &'static str = "audit.item";
}

/// Records every application of an event in `applied`.
#[derive(Clone)]
struct Apply;

impl Handler for Apply {
    type Message = Item;

    async fn handle(
        &self,
        event: Envelope<Item>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        sqlx::query("insert into applied (event_id, n) values ($1, $2)")
            .bind(*event.id().as_uuid())
            .bind(event.data().n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// The body of `GET /metrics`.
async fn scrape(addr: SocketAddr) -> Option<String> {
    super::support::http::get(addr, "/metrics", Duration::from_secs(10))
        .await
        .map(|(_, body)| body)
}

fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// One `outbox-relay` for these tests: a 5 s duplicate window, lease 2 s,
/// publish timeout 1 s, audit every 300 ms over the last 10 minutes.
struct Relay {
    program: Program,
    log: PathBuf,
    metrics: SocketAddr,
}

impl Relay {
    async fn start(db: &TestDb, nats_url: &str, stream: &str, name: &str, audit: bool) -> Self {
        let dir = std::env::temp_dir().join("audit-tests").join(db.name());
        std::fs::create_dir_all(&dir).unwrap();
        let metrics = super::support::http::free_addr();
        let mut program = Program::new(name, super::support::bin_dir().join("outbox-relay"), &dir)
            .env("DATABASE_URL", db.url())
            .env("NATS_URL", nats_url)
            .args(["--stream", stream, "--subjects", "audit.>"])
            .args([
                "--duplicate-window",
                "5s",
                "--lease",
                "2s",
                "--publish-timeout",
                "1s",
            ])
            .args(["--audit-horizon", if audit { "10m" } else { "0s" }])
            .args(["--audit-interval", "300ms", "--poll-interval", "100ms"])
            .args(["--backoff-base", "100ms", "--max-backoff", "1s"])
            .args(["--retention", "0s", "--metrics-addr", &metrics.to_string()]);
        program.start().await.unwrap();
        let relay = Self {
            log: dir.join(format!("{name}.log")),
            program,
            metrics,
        };
        wait_until("the relay to start", WAIT, || async {
            relay.log().contains("outbox relay started")
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));
        relay
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The warn lines of rows made unpublished again, by event id.
    fn republished(&self) -> BTreeMap<Uuid, usize> {
        let mut out = BTreeMap::new();
        for line in self.log().lines().filter(|l| l.contains(LOST_LINE)) {
            let id = line
                .split("event_id=")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .unwrap_or_else(|| panic!("no event_id in {line}"));
            *out.entry(id.parse().unwrap()).or_default() += 1;
        }
        out
    }

    async fn counter(&self, name: &str) -> f64 {
        sample(&scrape(self.metrics).await.unwrap_or_default(), name)
    }

    async fn stop(&mut self) {
        assert_eq!(self.program.terminate().await, Some(0), "{}", self.log());
    }
}

/// Writes `n` events, numbered from `first`, each of its own subject.
async fn write(db: &TestDb, first: i64, n: i64) -> Vec<Uuid> {
    let events: Vec<_> = (first..first + n)
        .map(|i| {
            Envelope::new(
                Item::TYPE,
                "audit-tests",
                format!("item-{i}"),
                Item { n: i },
            )
            .unwrap()
        })
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::unvalidated()
        .enqueue_all(&mut tx, &events)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    events.iter().map(|e| *e.id().as_uuid()).collect()
}

/// Each row's (stream, seq) once published, by id.
async fn positions(db: &TestDb, ids: &[Uuid]) -> BTreeMap<Uuid, Option<(String, i64)>> {
    let rows: Vec<(Uuid, Option<String>, Option<i64>, bool)> = sqlx::query_as(
        "select id, published_stream, published_seq, published_at is not null
           from outbox_events where id = any($1)",
    )
    .bind(ids)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(id, stream, seq, published)| {
            let position = match (published, stream, seq) {
                (true, Some(s), Some(q)) => Some((s, q)),
                _ => None,
            };
            (id, position)
        })
        .collect()
}

async fn all_published(db: &TestDb, ids: &[Uuid]) -> bool {
    positions(db, ids).await.values().all(Option::is_some)
}

/// `Nats-Msg-Id` of every message in `stream`, by sequence.
async fn stream_ids(js: &jetstream::Context, stream: &str) -> BTreeMap<u64, String> {
    let mut stream = js.get_stream(stream).await.unwrap();
    let total = stream.info().await.unwrap().state.messages as usize;
    let mut out = BTreeMap::new();
    if total == 0 {
        return out;
    }
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    while out.len() < total {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("reading the stream timed out")
            .unwrap()
            .unwrap();
        let seq = message.info().unwrap().stream_sequence;
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        out.insert(seq, id);
    }
    out
}

/// How often each id is in the stream.
fn id_counts(ids: &BTreeMap<u64, String>) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for id in ids.values() {
        *out.entry(id.clone()).or_default() += 1;
    }
    out
}

async fn applied(db: &TestDb) -> BTreeMap<Uuid, i64> {
    let rows: Vec<(Uuid, i64)> =
        sqlx::query_as("select event_id, count(*) from applied group by event_id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    rows.into_iter().collect()
}

async fn inbox_rows(db: &TestDb, durable: &str) -> i64 {
    sqlx::query_scalar("select count(*) from inbox_events where consumer = $1")
        .bind(durable)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

fn start_consumer(
    client: &async_nats::Client,
    db: &TestDb,
    stream: &str,
    durable: &str,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<Result<(), inbox_consumer::Error>> {
    tokio::spawn(
        Consumer::builder(db.pool.clone(), client.clone(), stream, durable)
            .handler(Apply)
            .stream_patience(WAIT)
            .run(stop.clone().cancelled_owned()),
    )
}

fn unique(db: &TestDb, prefix: &str) -> String {
    format!("{prefix}_{}", &db.name()[db.name().len() - 12..]).to_uppercase()
}

async fn new_db() -> TestDb {
    let db = TestDb::new().await.unwrap();
    sqlx::raw_sql("create table applied (event_id uuid not null, n bigint not null)")
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_messages_are_republished_once_and_applied_once() {
    let db = new_db().await;
    let nats = outbox_testkit::nats().unwrap();
    let stream = unique(&db, "AUDIT_DEL");
    let mut relay = Relay::start(&db, nats.url(), &stream, "relay", true).await;

    let ids = write(&db, 0, 20).await;
    wait_until("every row published", WAIT, || all_published(&db, &ids))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));
    let before = positions(&db, &ids).await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    // Each row holds the position of its message.
    let in_stream = stream_ids(&js, &stream).await;
    for (id, position) in &before {
        let (s, seq) = position.clone().unwrap();
        assert_eq!(s, stream);
        assert_eq!(in_stream[&(seq as u64)], id.to_string());
    }

    // Half the messages lost.
    let (lost, kept) = ids.split_at(10);
    let js_stream = js.get_stream(&stream).await.unwrap();
    for id in lost {
        let seq = before[id].clone().unwrap().1;
        assert!(js_stream.delete_message(seq as u64).await.unwrap());
    }

    let stop = CancellationToken::new();
    let consumer = start_consumer(&client, &db, &stream, "audited", &stop);

    // The lost rows are published again, at new sequences.
    let last = before.values().map(|p| p.clone().unwrap().1).max().unwrap();
    wait_until(
        "the lost rows republished at new sequences",
        WAIT,
        || async {
            positions(&db, lost)
                .await
                .values()
                .all(|p| p.as_ref().is_some_and(|(_, seq)| *seq > last))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));
    wait_until("every event applied", WAIT, || async {
        applied(&db).await.len() == ids.len()
    })
    .await
    .unwrap();

    // Wait until the republished rows were audited in turn (every row
    // checked once, the lost ones twice): no second republish.
    let total = (ids.len() + lost.len()) as f64;
    wait_until("the republished rows audited", WAIT, || async {
        relay.counter("outbox_relay_audit_checked_total").await >= total
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));

    let republished = relay.republished();
    assert_eq!(
        republished.keys().copied().collect::<BTreeSet<_>>(),
        lost.iter().copied().collect::<BTreeSet<_>>(),
        "{}",
        relay.log()
    );
    assert!(republished.values().all(|&n| n == 1), "{republished:?}");
    assert_eq!(
        relay.counter("outbox_relay_audit_republished_total").await,
        10.0
    );
    assert!(relay.log().contains("no message at the sequence"));
    // The control group is untouched.
    let after = positions(&db, &ids).await;
    for id in kept {
        assert_eq!(after[id], before[id], "an intact row changed");
    }
    // The stream holds each id once again.
    let counts = id_counts(&stream_ids(&js, &stream).await);
    for id in &ids {
        assert_eq!(counts.get(&id.to_string()), Some(&1), "{counts:?}");
    }
    assert_eq!(counts.len(), ids.len());
    // Applied exactly once each, with an inbox row each.
    let applied = applied(&db).await;
    assert_eq!(applied.len(), ids.len());
    assert!(applied.values().all(|&n| n == 1), "{applied:?}");
    assert_eq!(inbox_rows(&db, "audited").await, ids.len() as i64);

    // `outboxctl audit` finds nothing lost now.
    let report = outboxctl(&db, nats.url(), &["audit", "--stream", &stream]).await;
    assert_eq!(report["missing"], 0, "{report}");
    assert_eq!(
        report["checked"].as_u64().unwrap(),
        ids.len() as u64,
        "{report}"
    );

    stop.cancel();
    consumer.await.unwrap().unwrap();
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_lost_in_a_restart_is_republished_and_reused_sequences_told_apart() {
    let db = new_db().await;
    let store = tempfile::tempdir().unwrap();
    let store_arg = store.path().display().to_string();
    let mut server =
        tokio::task::spawn_blocking(move || NatsServer::start_with_args(&["-sd", &store_arg]))
            .await
            .unwrap()
            .unwrap();
    let url = server.url();
    let stream = unique(&db, "AUDIT_LOST");

    // 10 events acked and marked, by a relay without the audit.
    let mut relay = Relay::start(&db, &url, &stream, "relay-1", false).await;
    assert!(relay.log().contains("the audit is off"), "{}", relay.log());
    let lost = write(&db, 0, 10).await;
    wait_until("the first rows published", WAIT, || {
        all_published(&db, &lost)
    })
    .await
    .unwrap();
    relay.stop().await;
    let before = positions(&db, &lost).await;
    let first_seqs: BTreeSet<i64> = before.values().map(|p| p.clone().unwrap().1).collect();
    assert_eq!(first_seqs, (1..=10).collect());

    // The server stops; its store loses the stream's messages (the stream's
    // config stays).
    let server = tokio::task::spawn_blocking(move || {
        server.stop().unwrap();
        server
    })
    .await
    .unwrap();
    let msgs = find_dir(store.path(), &stream).join("msgs");
    assert!(msgs.is_dir(), "no {}", msgs.display());
    std::fs::remove_dir_all(&msgs).unwrap();
    let mut server = tokio::task::spawn_blocking(move || {
        let mut server = server;
        server.start_again().unwrap();
        server
    })
    .await
    .unwrap();
    let client = async_nats::connect(&url).await.unwrap();
    let js = jetstream::new(client.clone());
    assert_eq!(
        js.get_stream(&stream)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages,
        0
    );

    // 3 later events get the lost sequences 1..3.
    let mut relay = Relay::start(&db, &url, &stream, "relay-2", false).await;
    let later = write(&db, 100, 3).await;
    wait_until("the later rows published", WAIT, || {
        all_published(&db, &later)
    })
    .await
    .unwrap();
    relay.stop().await;
    let later_at = positions(&db, &later).await;
    let reused: BTreeSet<i64> = later_at.values().map(|p| p.clone().unwrap().1).collect();
    assert_eq!(reused, BTreeSet::from([1, 2, 3]));

    // The auditing relay republishes each lost row once.
    let stop = CancellationToken::new();
    let consumer = start_consumer(&client, &db, &stream, "restored", &stop);
    let mut relay = Relay::start(&db, &url, &stream, "relay-3", true).await;
    // Published again (a republish may land at its old sequence again, so the
    // time it was marked tells, not the position).
    let marked_before: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("select max(published_at) from outbox_events where id = any($1)")
            .bind(&lost)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    wait_until("every lost row republished", WAIT, || async {
        let again: i64 = sqlx::query_scalar(
            "select count(*) from outbox_events where id = any($1) and published_at > $2",
        )
        .bind(&lost)
        .bind(marked_before)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        again == lost.len() as i64 && all_published(&db, &lost).await
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));
    let everything: Vec<Uuid> = lost.iter().chain(&later).copied().collect();
    wait_until("every event applied", WAIT, || async {
        applied(&db).await.len() == everything.len()
    })
    .await
    .unwrap();
    let total = (everything.len() + lost.len()) as f64;
    wait_until("the republished rows audited", WAIT, || async {
        relay.counter("outbox_relay_audit_checked_total").await >= total
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));

    let republished = relay.republished();
    assert_eq!(
        republished.keys().copied().collect::<BTreeSet<_>>(),
        lost.iter().copied().collect::<BTreeSet<_>>(),
        "{}",
        relay.log()
    );
    assert!(republished.values().all(|&n| n == 1), "{republished:?}");
    // The rows at the reused sequences found the later events there (rows
    // at higher sequences may find republished copies of other lost rows).
    let log = relay.log();
    for seq in 1..=3 {
        let line = log
            .lines()
            .find(|l| l.contains(LOST_LINE) && l.contains(&format!(" seq={seq} ")))
            .unwrap_or_else(|| panic!("no finding at seq {seq}:\n{log}"));
        assert!(
            later.iter().any(|id| line.contains(&format!(
                "another message at the sequence (Nats-Msg-Id {id},"
            ))),
            "{line}"
        );
    }
    // The later rows, at reused sequences, are left alone.
    assert_eq!(positions(&db, &later).await, later_at);
    let counts = id_counts(&stream_ids(&js, &stream).await);
    for id in &everything {
        assert_eq!(counts.get(&id.to_string()), Some(&1), "{counts:?}");
    }
    let applied = applied(&db).await;
    assert!(applied.values().all(|&n| n == 1), "{applied:?}");
    assert_eq!(inbox_rows(&db, "restored").await, everything.len() as i64);

    stop.cancel();
    consumer.await.unwrap().unwrap();
    relay.stop().await;
    drop(server.stop());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_while_the_broker_is_down_republishes_nothing() {
    let db = new_db().await;
    let mut nats = outbox_testkit::nats().unwrap();
    let url = nats.url().to_owned();
    let stream = unique(&db, "AUDIT_DOWN");
    let mut relay = Relay::start(&db, &url, &stream, "relay", true).await;
    let ids = write(&db, 0, 5).await;
    wait_until("every row published", WAIT, || all_published(&db, &ids))
        .await
        .unwrap();
    let before = positions(&db, &ids).await;

    // Down before the rows are old enough to audit; a pass fails meanwhile.
    let server = nats.server().expect("a server of the test's own");
    server.stop().unwrap();
    wait_until("an audit pass failing", WAIT, || async {
        relay.log().contains("audit pass failed")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));
    assert_eq!(positions(&db, &ids).await, before);
    server.start_again().unwrap();
    wait_until("the rows audited", WAIT, || async {
        relay.counter("outbox_relay_audit_checked_total").await >= ids.len() as f64
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));
    assert!(
        relay.log().contains("audit passes again"),
        "{}",
        relay.log()
    );
    assert!(relay.republished().is_empty(), "{}", relay.log());
    assert_eq!(
        relay.counter("outbox_relay_audit_republished_total").await,
        0.0
    );
    assert_eq!(positions(&db, &ids).await, before);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outboxctl_audit_reports_lost_rows_and_hands_them_to_the_relay() {
    let db = new_db().await;
    let nats = outbox_testkit::nats().unwrap();
    let stream = unique(&db, "AUDIT_CTL");
    // The relay without its own audit: outboxctl finds the loss.
    let mut relay = Relay::start(&db, nats.url(), &stream, "relay", false).await;
    let mut ids = write(&db, 0, 6).await;
    wait_until("every row published", WAIT, || all_published(&db, &ids))
        .await
        .unwrap();
    // 200 messages of another publisher, then 2 more rows: the rows'
    // sequences are sparse, so the audit reads them one by one (the relay's
    // own tests above read dense ranges through a consumer).
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    for _ in 0..200 {
        js.publish("audit.foreign", "x".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let more = write(&db, 100, 2).await;
    wait_until("the later rows published", WAIT, || {
        all_published(&db, &more)
    })
    .await
    .unwrap();
    ids.extend(more);
    let before = positions(&db, &ids).await;
    assert!(before.values().any(|p| p.as_ref().unwrap().1 > 200));
    let js_stream = js.get_stream(&stream).await.unwrap();
    let lost = &ids[..2];
    for id in lost {
        js_stream
            .delete_message(before[id].clone().unwrap().1 as u64)
            .await
            .unwrap();
    }

    let report = outboxctl(
        &db,
        nats.url(),
        &["audit", "--stream", &stream, "--since", "10m"],
    )
    .await;
    assert_eq!(report["checked"], 8, "{report}");
    assert_eq!(report["missing"], 2, "{report}");
    assert_eq!(report["republished"], 0, "{report}");
    let found: BTreeSet<Uuid> = report["lost"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(found, lost.iter().copied().collect());
    // Nothing changed without --republish.
    assert_eq!(positions(&db, &ids).await, before);

    // --republish takes rows published longer ago than the duplicate window
    // plus its margin (6.25 s) only.
    wait_until("the rows older than 6.25 s", WAIT, || async {
        sqlx::query_scalar::<_, bool>(
            "select bool_and(published_at < now() - interval '6.5 seconds') from outbox_events",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    })
    .await
    .unwrap();
    let report = outboxctl(
        &db,
        nats.url(),
        &[
            "audit",
            "--stream",
            &stream,
            "--since",
            "10m",
            "--republish",
        ],
    )
    .await;
    assert_eq!(report["missing"], 2, "{report}");
    assert_eq!(report["republished"], 2, "{report}");
    wait_until("the relay republishing the lost rows", WAIT, || async {
        positions(&db, lost)
            .await
            .iter()
            .all(|(id, p)| p.is_some() && *p != before[id])
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));
    let report = outboxctl(&db, nats.url(), &["audit", "--stream", &stream]).await;
    assert_eq!(report["missing"], 0, "{report}");

    // NATS not reachable: one line, exit 1.
    let out = outboxctl_raw(
        &db,
        "nats://127.0.0.1:1",
        &["audit", "--stream", &stream, "--timeout", "2s"],
    )
    .await;
    assert_eq!(out.0, Some(1), "{}", out.2);
    assert_eq!(out.2.trim_end().lines().count(), 1, "{}", out.2);
    assert!(out.2.starts_with("outboxctl: "), "{}", out.2);
    relay.stop().await;
}

/// `outboxctl --json <args>`, successful, as JSON.
async fn outboxctl(db: &TestDb, nats_url: &str, args: &[&str]) -> Value {
    let (code, stdout, stderr) = outboxctl_raw(db, nats_url, args).await;
    assert_eq!(
        code,
        Some(0),
        "outboxctl failed\nstdout: {stdout}\nstderr: {stderr}"
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

async fn outboxctl_raw(
    db: &TestDb,
    nats_url: &str,
    args: &[&str],
) -> (Option<i32>, String, String) {
    let bin = super::support::bin_dir().join("outboxctl");
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(bin)
            .arg("--json")
            .args(args)
            .env("DATABASE_URL", db.url())
            .env("NATS_URL", nats_url)
            .env_remove("DATABASE_URL_FILE")
            .env_remove("OUTBOX_STREAM")
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The directory named `name` under `root`, at any depth.
fn find_dir(root: &std::path::Path, name: &str) -> PathBuf {
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                if entry.file_name() == name {
                    return path;
                }
                stack.push(path);
            }
        }
    }
    panic!("no directory {name} under {}", root.display());
}

/// What the server's dedupe map does, which the audit's wait past the
/// duplicate window rests on: after a message is deleted, or its stream
/// purged, a publish of the same `Nats-Msg-Id` within the window is acked as
/// a duplicate (with the deleted message's sequence) and not stored; after a
/// restart that lost the store, the id is forgotten and stored at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dedupe_map_outlives_a_delete_and_a_purge_not_a_lost_store() {
    let store = tempfile::tempdir().unwrap();
    let store_arg = store.path().display().to_string();
    let mut server =
        tokio::task::spawn_blocking(move || NatsServer::start_with_args(&["-sd", &store_arg]))
            .await
            .unwrap()
            .unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client);
    let name = "AUDIT_DEDUPE";
    js.create_stream(jetstream::stream::Config {
        name: name.into(),
        subjects: vec!["dedupe.>".into()],
        duplicate_window: Duration::from_secs(60),
        ..Default::default()
    })
    .await
    .unwrap();
    let publish = |id: &'static str| {
        let js = js.clone();
        async move {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", id);
            js.publish_with_headers("dedupe.x", headers, "x".into())
                .await
                .unwrap()
                .await
                .unwrap()
        }
    };
    let messages = |js: jetstream::Context| async move {
        js.get_stream(name)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages
    };

    // Deleted, then published again within the window: a duplicate.
    let first = publish("a").await;
    assert!(!first.duplicate);
    let stream = js.get_stream(name).await.unwrap();
    assert!(stream.delete_message(first.sequence).await.unwrap());
    let again = publish("a").await;
    assert!(again.duplicate, "{again:?}");
    assert_eq!(again.sequence, first.sequence);
    assert_eq!(messages(js.clone()).await, 0);

    // Purged, then published again within the window: a duplicate too.
    let b = publish("b").await;
    stream.purge().await.unwrap();
    let again = publish("b").await;
    assert!(again.duplicate, "{again:?}");
    assert_eq!(again.sequence, b.sequence);
    assert_eq!(messages(js.clone()).await, 0);

    // A store lost in a restart: the ids are forgotten.
    let c = publish("c").await;
    assert!(!c.duplicate);
    let server = tokio::task::spawn_blocking(move || {
        server.stop().unwrap();
        server
    })
    .await
    .unwrap();
    std::fs::remove_dir_all(find_dir(store.path(), name).join("msgs")).unwrap();
    let mut server = tokio::task::spawn_blocking(move || {
        let mut server = server;
        server.start_again().unwrap();
        server
    })
    .await
    .unwrap();
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = jetstream::new(client);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "c");
    let again = js
        .publish_with_headers("dedupe.x", headers, "x".into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(!again.duplicate, "{again:?}");
    assert_eq!(messages(js.clone()).await, 1);
    drop(server.stop());
}

/// A custom sink whose broker has no stream positions: acks without one.
struct NoPositions;

impl outbox_publisher::Sink for NoPositions {
    async fn publish(
        &self,
        _message: outbox_publisher::OutgoingMessage,
    ) -> Result<outbox_publisher::PublishAck, outbox_publisher::PublishFailure> {
        Ok(outbox_publisher::PublishAck::without_position(false))
    }
}

/// A `Sink` of its own that reports no stream position still publishes:
/// its rows are marked published without one, and the audit passes them
/// over (outboxctl audit checks none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_without_positions_marks_rows_published_without_one() {
    let db = new_db().await;
    let ids = write(&db, 0, 5).await;
    let relay = outbox_publisher::Relay::new(
        db.pool.clone(),
        NoPositions,
        outbox_publisher::RelayConfig::default(),
    )
    .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(report.published, ids.len());
    let rows: Vec<(bool, Option<String>, Option<i64>)> = sqlx::query_as(
        "select published_at is not null, published_stream, published_seq from outbox_events",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), ids.len());
    assert!(rows.iter().all(|r| *r == (true, None, None)), "{rows:?}");

    let nats = outbox_testkit::nats().unwrap();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_stream(jetstream::stream::Config {
        name: "AUDIT_NOPOS".into(),
        subjects: vec!["audit.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let report = outboxctl(&db, nats.url(), &["audit", "--stream", "AUDIT_NOPOS"]).await;
    assert_eq!(report["checked"], 0, "{report}");
}
