//! Any bytes the server accepts are a message, not a crash and not a ghost.
//!
//! Messages are written as an attacker writes them: the NATS protocol on a
//! raw socket (`HPUB`), so header blocks hold what client libraries never
//! send: a bare CR, a bare LF, NUL, bytes that are not UTF-8, a line without
//! a colon, a status line, a block near the server's limit, a `Nats-Msg-Id`
//! of several KB; and bodies that are empty, binary, or `max_payload` long.
//! Each goes between valid events into a consumer of each mode (ordered,
//! unordered, batched): the shipped `billing` as a process, and a consumer
//! built with `Consumer::builder`. Each time the process stays up, every
//! valid event is handled once, and each hostile message is settled: handled
//! when the client can read it and it is a valid event, otherwise a dead
//! letter with its reason (`undecodable_headers` keeps the header block
//! byte for byte in `raw_headers`), and nothing is left pending on the
//! durable.
//!
//! The binaries are built by `scripts/test` before the tests run.

mod support;

use std::time::Duration;

use async_nats::jetstream;
use outbox_testkit::{NatsServer, PgServer, Program, TestDb, wait_until};
use serde_json::json;
use support::{blocking, count};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(120);
const STREAM: &str = "OUTBOX";

/// What must become of a hostile message.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Outcome {
    /// Its body is a valid event and the client reads its headers: handled.
    Handled,
    /// Dead-lettered with this reason.
    Dead(&'static str),
}

/// One hostile message: a name, its header block (empty: none), and whether
/// its body is a valid event (else `body`).
struct Case {
    name: &'static str,
    headers: Vec<u8>,
    body: Body,
    outcome: Outcome,
}

enum Body {
    /// A valid `subscription.created` for `hostile-<name>`.
    Event,
    Bytes(Vec<u8>),
    /// Filler up to the server's `max_payload` (with the headers).
    MaxPayload,
}

fn block(lines: &[&[u8]]) -> Vec<u8> {
    let mut block = b"NATS/1.0\r\n".to_vec();
    for line in lines {
        block.extend_from_slice(line);
        block.extend_from_slice(b"\r\n");
    }
    block.extend_from_slice(b"\r\n");
    block
}

fn cases() -> Vec<Case> {
    let undecodable = Outcome::Dead("undecodable_headers");
    let long_id = [b"Nats-Msg-Id: ".as_slice(), &vec![b'k'; 4_096]].concat();
    vec![
        Case {
            name: "cr-in-value",
            headers: block(&[b"X-Note: a\rb"]),
            body: Body::Event,
            outcome: Outcome::Handled,
        },
        Case {
            name: "lf-in-value",
            headers: block(&[b"X-Note: a\nb"]),
            body: Body::Event,
            outcome: undecodable,
        },
        Case {
            name: "nul-in-value",
            headers: block(&[b"X-Note: a\0b"]),
            body: Body::Event,
            outcome: Outcome::Handled,
        },
        Case {
            name: "non-utf8-name",
            headers: block(&[b"X-\xffNote: v"]),
            body: Body::Event,
            outcome: undecodable,
        },
        Case {
            name: "non-utf8-value",
            headers: block(&[b"X-Note: \xff\xfe"]),
            body: Body::Event,
            outcome: undecodable,
        },
        Case {
            name: "no-colon",
            headers: block(&[b"X-Note-without-a-colon"]),
            body: Body::Event,
            outcome: undecodable,
        },
        // The server stores the block with its version line made plain
        // (`NATS/1.0`), so a status written by a publisher never reaches a
        // consumer as one: handled.
        Case {
            name: "status-line",
            headers: b"NATS/1.0 503 Down\r\nX-Note: v\r\n\r\n".to_vec(),
            body: Body::Event,
            outcome: Outcome::Handled,
        },
        Case {
            // Filled up to JetStream's limit when published.
            name: "large-header-block",
            headers: Vec::new(),
            body: Body::Event,
            outcome: Outcome::Handled,
        },
        Case {
            name: "long-msg-id",
            headers: block(&[&long_id]),
            body: Body::Event,
            outcome: Outcome::Handled,
        },
        Case {
            name: "empty-body",
            headers: block(&[b"X-Note: empty"]),
            body: Body::Bytes(Vec::new()),
            outcome: Outcome::Dead("not_json"),
        },
        Case {
            name: "binary-body",
            headers: Vec::new(),
            body: Body::Bytes((0..=255u8).rev().cycle().take(1_000).collect()),
            outcome: Outcome::Dead("not_json"),
        },
        Case {
            name: "lf-in-value-max-payload-body",
            headers: block(&[b"X-Note: a\nb"]),
            body: Body::MaxPayload,
            outcome: undecodable,
        },
        Case {
            name: "max-payload-body",
            headers: block(&[b"X-Note: full"]),
            body: Body::MaxPayload,
            outcome: Outcome::Dead("not_json"),
        },
    ]
}

/// A valid `subscription.created` for `subscription`, as another language's
/// producer writes it.
fn created(subscription: &str) -> (String, Vec<u8>) {
    let id = Uuid::now_v7().to_string();
    let body = json!({
        "specversion": "1.0", "id": id, "source": "subscriptions",
        "type": "subscription.created", "subject": subscription,
        "time": "2026-12-01T00:00:00Z", "datacontenttype": "application/json",
        "data": {"subscription_id": subscription, "customer_id": "c1", "amount_cents": 1200},
    });
    (id, serde_json::to_vec(&body).unwrap())
}

/// A NATS connection written by hand: what any client allowed on the
/// subject can send, whatever a client library would refuse.
struct Raw {
    reader: BufReader<tokio::net::tcp::OwnedReadHalf>,
    writer: tokio::net::tcp::OwnedWriteHalf,
    max_payload: usize,
}

impl Raw {
    async fn connect(url: &str) -> Raw {
        let address = url.trim_start_matches("nats://");
        let (read, writer) = tokio::net::TcpStream::connect(address)
            .await
            .unwrap()
            .into_split();
        let mut raw = Raw {
            reader: BufReader::new(read),
            writer,
            max_payload: 0,
        };
        let info = raw.line().await;
        let info: serde_json::Value =
            serde_json::from_str(info.trim_start_matches("INFO ")).unwrap();
        raw.max_payload = usize::try_from(info["max_payload"].as_u64().unwrap()).unwrap();
        raw.send(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\nSUB _RAW.acks 1\r\n")
            .await;
        raw
    }

    async fn line(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).await.unwrap();
        line.trim_end().to_owned()
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).await.unwrap();
        self.writer.flush().await.unwrap();
    }

    /// Publishes `headers` (none if empty) and `body` on `subject` and
    /// returns the stream sequence JetStream stored it at.
    async fn publish(&mut self, subject: &str, headers: &[u8], body: &[u8]) -> u64 {
        let mut frame = if headers.is_empty() {
            format!("PUB {subject} _RAW.acks {}\r\n", body.len()).into_bytes()
        } else {
            format!(
                "HPUB {subject} _RAW.acks {} {}\r\n",
                headers.len(),
                headers.len() + body.len()
            )
            .into_bytes()
        };
        frame.extend_from_slice(headers);
        frame.extend_from_slice(body);
        frame.extend_from_slice(b"\r\n");
        self.send(&frame).await;
        loop {
            let line = self.line().await;
            if line == "PING" {
                self.send(b"PONG\r\n").await;
                continue;
            }
            if line.starts_with("-ERR") {
                panic!("the server refused a raw publish: {line}");
            }
            let Some(args) = line.strip_prefix("MSG _RAW.acks 1 ") else {
                continue;
            };
            let len: usize = args.trim().parse().unwrap();
            let mut ack = vec![0; len + 2];
            tokio::io::AsyncReadExt::read_exact(&mut self.reader, &mut ack)
                .await
                .unwrap();
            let ack: serde_json::Value = serde_json::from_slice(&ack[..len]).unwrap();
            assert!(ack.get("error").is_none(), "not stored: {ack}");
            return ack["seq"]
                .as_u64()
                .unwrap_or_else(|| panic!("not stored: {ack}"));
        }
    }
}

/// What was published: valid subscriptions, and each hostile case at its
/// stream sequence.
struct Published {
    valid: Vec<String>,
    hostile: Vec<(Case, u64, Vec<u8>)>,
}

/// Publishes 4 valid events before each hostile case (and 4 after the
/// last), all raw.
async fn publish(url: &str, tag: &str) -> Published {
    let mut raw = Raw::connect(url).await;
    let mut published = Published {
        valid: Vec::new(),
        hostile: Vec::new(),
    };
    for case in cases() {
        for i in 0..4 {
            let subscription = format!("{tag}-{}-{i}", case.name);
            let (id, body) = created(&subscription);
            let headers = block(&[format!("Nats-Msg-Id: {id}").as_bytes()]);
            raw.publish("subscription.created", &headers, &body).await;
            published.valid.push(subscription);
        }
        let mut case = case;
        let body = match &case.body {
            Body::Event => created(&format!("{tag}-hostile-{}", case.name)).1,
            Body::Bytes(bytes) => bytes.clone(),
            Body::MaxPayload => vec![b'x'; raw.max_payload - case.headers.len()],
        };
        if case.name == "large-header-block" {
            // JetStream stores a header block of at most 64 KiB: this one
            // comes within 64 bytes of it.
            let room = 64 * 1024 - 64 - b"NATS/1.0\r\nX-Big: \r\n\r\n".len();
            case.headers = block(&[&[b"X-Big: ".as_slice(), &vec![b'a'; room]].concat()]);
        }
        let seq = raw
            .publish("subscription.created", &case.headers, &body)
            .await;
        published.hostile.push((case, seq, body));
    }
    for i in 0..4 {
        let subscription = format!("{tag}-last-{i}");
        let (_, body) = created(&subscription);
        raw.publish("subscription.created", &[], &body).await;
        published.valid.push(subscription);
    }
    published
}

/// Waits until every message is settled as it must be, then checks each.
async fn assert_settled(
    db: &sqlx::PgPool,
    js: &jetstream::Context,
    durable: &str,
    published: &Published,
    invoices: &str,
    log: impl Fn() -> String,
) {
    let handled = published
        .hostile
        .iter()
        .filter(|(case, ..)| case.outcome == Outcome::Handled)
        .count();
    let dead = published.hostile.len() - handled;
    let expected = i64::try_from(published.valid.len() + handled).unwrap();
    let every = format!(
        "{} invoices and {dead} dead letters",
        published.valid.len() + handled
    );
    wait_until(&every, WAIT, || async {
        count(db, &format!("select count(*) from {invoices}")).await == expected
            && count(
                db,
                &format!("select count(*) from inbox_dead_letters where consumer = '{durable}'"),
            )
            .await
                == i64::try_from(dead).unwrap()
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}\ndead letters: {:?}\n{}",
            blocking_rows(db, durable),
            log()
        )
    });
    support::wait_acked(js, STREAM, durable, WAIT).await;
    assert_eq!(
        count(
            db,
            &format!("select count(distinct subscription_id) from {invoices}")
        )
        .await,
        expected,
        "each event applied once"
    );
    for (case, seq, body) in &published.hostile {
        let row: Option<(String, Option<Vec<u8>>, Vec<u8>)> = sqlx::query_as(
            "select reason, raw_headers, payload from inbox_dead_letters
              where consumer = $1 and stream_sequence = $2",
        )
        .bind(durable)
        .bind(i64::try_from(*seq).unwrap())
        .fetch_optional(db)
        .await
        .unwrap();
        match case.outcome {
            Outcome::Handled => assert!(row.is_none(), "{}: dead-lettered: {row:?}", case.name),
            Outcome::Dead(reason) => {
                let (got, raw_headers, payload) =
                    row.unwrap_or_else(|| panic!("{}: no dead letter", case.name));
                assert_eq!(got, reason, "{}", case.name);
                assert_eq!(&payload, body, "{}: the body as stored", case.name);
                if reason == "undecodable_headers" {
                    assert_eq!(
                        raw_headers.as_deref(),
                        Some(case.headers.as_slice()),
                        "{}: the header block as stored",
                        case.name
                    );
                }
            }
        }
    }
}

fn blocking_rows(db: &sqlx::PgPool, durable: &str) -> Vec<(i64, String)> {
    let db = db.clone();
    let durable = durable.to_owned();
    std::thread::spawn(move || {
        tokio::runtime::Runtime::new().unwrap().block_on(async {
            sqlx::query_as("select stream_sequence, reason from inbox_dead_letters where consumer = $1 order by 1")
                .bind(durable)
                .fetch_all(&db)
                .await
                .unwrap_or_default()
        })
    })
    .join()
    .unwrap()
}

/// A server pair of the test's own, the stream made.
struct World {
    _pg: PgServer,
    db: TestDb,
    nats: NatsServer,
    js: jetstream::Context,
    log_dir: std::path::PathBuf,
}

async fn world(tag: &str) -> World {
    let pg = blocking(PgServer::start).unwrap();
    let db = TestDb::on(&pg).await.unwrap();
    let nats: NatsServer = blocking(NatsServer::start).unwrap();
    let js = support::billing_stream(&nats.url(), STREAM).await;
    let log_dir = std::env::temp_dir()
        .join("outbox-hostile")
        .join(format!("{tag}-{}", db.name()));
    std::fs::create_dir_all(&log_dir).unwrap();
    World {
        _pg: pg,
        db,
        nats,
        js,
        log_dir,
    }
}

impl World {
    fn billing(&self, flags: &[&str]) -> Program {
        Program::new("billing", support::bin_dir().join("billing"), &self.log_dir)
            .env("DATABASE_URL", self.db.url())
            .env("NATS_URL", self.nats.url())
            .args([
                "--stream",
                STREAM,
                "--consumer",
                "billing",
                "--no-relay",
                "--ack-wait",
                "5s",
            ])
            .args(flags.iter().copied())
            .ready_when("billing ready")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_dir.join("billing.log")).unwrap_or_default()
    }
}

/// `billing` with `flags`, against raw hostile messages.
async fn billing_settles_everything(tag: &str, flags: &[&str]) {
    let world = world(tag).await;
    let mut billing = world.billing(flags);
    billing.start().await.unwrap();
    let published = publish(&world.nats.url(), tag).await;
    assert_settled(
        &world.db.pool,
        &world.js,
        "billing",
        &published,
        "invoices",
        || world.log(),
    )
    .await;
    support::assert_running(&mut billing, &world.log_dir.join("billing.log"));
    assert_eq!(billing.terminate().await, Some(0), "{}", world.log());
    let _ = std::fs::remove_dir_all(&world.log_dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn billing_ordered_and_batched_by_default_settles_every_hostile_message() {
    billing_settles_everything("ordered", &[]).await;
}

/// `outboxctl --json <args>` against `world`, to completion.
async fn outboxctl(world: &World, args: &[&str]) -> serde_json::Value {
    let out = tokio::process::Command::new(support::bin_dir().join("outboxctl"))
        .arg("--json")
        .args(args)
        .env("DATABASE_URL", world.db.url())
        .env_remove("NATS_URL")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "outboxctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A message no client could read is a dead letter like any other:
/// `outboxctl dead-letters show` gives its header block as stored, and
/// `replay` puts its body back in front of the consumer (with the header
/// lines that could be read), which handles it.
#[tokio::test(flavor = "multi_thread")]
async fn an_unreadable_message_is_shown_and_replayed_with_outboxctl() {
    let world = world("replay").await;
    let mut billing = world.billing(&[]);
    billing.start().await.unwrap();
    let mut raw = Raw::connect(&world.nats.url()).await;
    let headers = block(&[b"Nats-Msg-Id: m-1", b"X-Note: a\nb"]);
    let seq = raw
        .publish("subscription.created", &headers, &created("replayed").1)
        .await;
    let id: i64 = {
        let pool = &world.db.pool;
        wait_until("the dead letter", WAIT, || async {
            count(pool, "select count(*) from inbox_dead_letters").await == 1
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", world.log()));
        sqlx::query_scalar("select id from inbox_dead_letters where stream_sequence = $1")
            .bind(i64::try_from(seq).unwrap())
            .fetch_one(pool)
            .await
            .unwrap()
    };
    let shown = outboxctl(&world, &["dead-letters", "show", &id.to_string()]).await;
    assert_eq!(shown["reason"], "undecodable_headers", "{shown}");
    assert_eq!(shown["raw_headers"]["encoding"], "text", "{shown}");
    assert_eq!(
        shown["raw_headers"]["value"],
        String::from_utf8(headers.clone()).unwrap(),
        "{shown}"
    );
    assert_eq!(shown["headers"]["Nats-Msg-Id"][0], "m-1", "{shown}");
    let nats_url = format!("--nats-url={}", world.nats.url());
    let replayed = outboxctl(
        &world,
        &["dead-letters", "replay", &id.to_string(), &nats_url],
    )
    .await;
    assert_eq!(replayed["replayed"][0]["id"], id, "{replayed}");
    wait_until("the replayed event handled", WAIT, || async {
        count(
            &world.db.pool,
            "select count(*) from invoices where subscription_id = 'replayed'",
        )
        .await
            == 1
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", world.log()));
    assert_eq!(billing.terminate().await, Some(0), "{}", world.log());
    let _ = std::fs::remove_dir_all(&world.log_dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn billing_unordered_one_at_a_time_settles_every_hostile_message() {
    billing_settles_everything("unordered", &["--unordered", "--batch", "1"]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn billing_unordered_batched_settles_every_hostile_message() {
    billing_settles_everything("batched", &["--unordered"]).await;
}

/// A leader killed with unreadable messages unsettled in the stream: the
/// next one's takeover reads the stream through the client too, and steps
/// over each one, settling it, instead of stopping at it for ever.
#[tokio::test(flavor = "multi_thread")]
async fn an_ordered_takeover_over_unreadable_messages_settles_them_and_goes_on() {
    let world = world("takeover").await;
    let mut billing = world.billing(&["--batch", "1"]);
    billing.start().await.unwrap();
    let published = publish(&world.nats.url(), "takeover").await;
    billing.kill9().await;
    let mut billing = world.billing(&["--batch", "1"]);
    billing.start().await.unwrap();
    assert_settled(
        &world.db.pool,
        &world.js,
        "billing",
        &published,
        "invoices",
        || world.log(),
    )
    .await;
    support::assert_running(&mut billing, &world.log_dir.join("billing.log"));
    assert_eq!(billing.terminate().await, Some(0), "{}", world.log());
    let _ = std::fs::remove_dir_all(&world.log_dir);
}

/// Applies each `subscription.created` once (its subscription is the key).
#[derive(Clone)]
struct Apply;

impl inbox_consumer::Handler for Apply {
    type Message = serde_json::Value;

    async fn handle(
        &self,
        event: outbox_pg::Envelope<serde_json::Value>,
        tx: &mut sqlx::PgTransaction<'static>,
    ) -> Result<(), inbox_consumer::HandlerError> {
        sqlx::query("insert into applied (subscription_id) values ($1)")
            .bind(event.data()["subscription_id"].as_str().unwrap_or_default())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// A consumer built with `Consumer::builder`, against raw hostile messages.
async fn the_builder_settles_everything(tag: &str, ordered: bool, batch: Option<usize>) {
    let world = world(tag).await;
    outbox_pg::migrate_with(
        &world.db.pool,
        "create table applied (subscription_id text primary key)",
    )
    .await
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut builder = inbox_consumer::Consumer::builder(
        world.db.pool.clone(),
        async_nats::connect(world.nats.url()).await.unwrap(),
        STREAM,
        "builder",
    )
    .route(
        "subscription.created",
        inbox_consumer::HandlerService::new(Apply),
    )
    .configure(|c| c.ordered(ordered).ack_wait(Duration::from_secs(5)));
    if let Some(max) = batch {
        builder = builder.batched(max);
    }
    let consumer = tokio::spawn(builder.run(stop.clone().cancelled_owned()));
    let published = publish(&world.nats.url(), tag).await;
    assert_settled(
        &world.db.pool,
        &world.js,
        "builder",
        &published,
        "applied",
        String::new,
    )
    .await;
    assert!(!consumer.is_finished(), "the consumer stopped");
    stop.cancel();
    consumer.await.unwrap().unwrap();
}

/// A consumer of the whole stream (no filter subject) whose leader dies
/// with unreadable messages unsettled: the next leader's takeover reads the
/// whole stream by sequence too, and steps over each one.
#[tokio::test(flavor = "multi_thread")]
async fn a_whole_stream_ordered_takeover_over_unreadable_messages_settles_them() {
    let world = world("whole-stream").await;
    outbox_pg::migrate_with(
        &world.db.pool,
        "create table applied (subscription_id text primary key)",
    )
    .await
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let start = |client: async_nats::Client| {
        tokio::spawn(
            inbox_consumer::Consumer::builder(world.db.pool.clone(), client, STREAM, "whole")
                .route(
                    "subscription.created",
                    inbox_consumer::HandlerService::new(Apply),
                )
                .whole_stream()
                .configure(|c| c.ordered(true).ack_wait(Duration::from_secs(5)))
                .run(stop.clone().cancelled_owned()),
        )
    };
    let first = start(async_nats::connect(world.nats.url()).await.unwrap());
    let published = publish(&world.nats.url(), "whole").await;
    // A crash: everything in flight is dropped unacked.
    first.abort();
    let _ = first.await;
    let consumer = start(async_nats::connect(world.nats.url()).await.unwrap());
    assert_settled(
        &world.db.pool,
        &world.js,
        "whole",
        &published,
        "applied",
        String::new,
    )
    .await;
    assert!(!consumer.is_finished(), "the consumer stopped");
    stop.cancel();
    consumer.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_builder_consumer_ordered_settles_every_hostile_message() {
    the_builder_settles_everything("builder-ordered", true, None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_builder_consumer_unordered_settles_every_hostile_message() {
    the_builder_settles_everything("builder-unordered", false, None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_builder_consumer_batched_settles_every_hostile_message() {
    the_builder_settles_everything("builder-batched", false, Some(32)).await;
}

/// Records each event applied, with its entity and when.
#[derive(Clone)]
struct Record;

impl inbox_consumer::Handler for Record {
    type Message = serde_json::Value;

    async fn handle(
        &self,
        event: outbox_pg::Envelope<serde_json::Value>,
        tx: &mut sqlx::PgTransaction<'static>,
    ) -> Result<(), inbox_consumer::HandlerError> {
        sqlx::query("insert into applied (event_id, entity, kind) values ($1, $2, $3)")
            .bind(uuid::Uuid::from(event.id()))
            .bind(event.subject())
            .bind(event.event_type().as_str())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// An ordered consumer applies no later event of an entity before the
/// entity's earlier event is settled, even when the client never handed the
/// earlier one over: each hostile `subscription.created` is followed, a
/// moment later (in another pull), by a valid `subscription.renewed` of the
/// same entity, which must be applied after the hostile one is applied or
/// dead-lettered.
#[tokio::test(flavor = "multi_thread")]
async fn an_ordered_consumer_applies_no_later_event_of_an_entity_before_an_unreadable_one_is_settled()
 {
    let world = world("order").await;
    outbox_pg::migrate_with(
        &world.db.pool,
        "create table applied (event_id uuid primary key, entity text not null, kind text not null,
                               applied_at timestamptz not null default clock_timestamp())",
    )
    .await
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let consumer = tokio::spawn(
        inbox_consumer::Consumer::builder(
            world.db.pool.clone(),
            async_nats::connect(world.nats.url()).await.unwrap(),
            STREAM,
            "ordered",
        )
        .route(
            "subscription.created",
            inbox_consumer::HandlerService::new(Record),
        )
        .route(
            "subscription.renewed",
            inbox_consumer::HandlerService::new(Record),
        )
        .configure(|c| c.ordered(true).ack_wait(Duration::from_secs(5)))
        .run(stop.clone().cancelled_owned()),
    );
    let mut raw = Raw::connect(&world.nats.url()).await;
    let mut hostile = Vec::new();
    for case in cases()
        .into_iter()
        .filter(|case| matches!(case.body, Body::Event))
    {
        let entity = format!("order-{}", case.name);
        let seq = raw
            .publish("subscription.created", &case.headers, &created(&entity).1)
            .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let renewed = json!({
            "specversion": "1.0", "id": Uuid::now_v7().to_string(), "source": "subscriptions",
            "type": "subscription.renewed", "subject": entity,
            "time": "2026-12-01T00:00:01Z", "datacontenttype": "application/json",
            "data": {"subscription_id": entity},
        });
        raw.publish(
            "subscription.renewed",
            &[],
            &serde_json::to_vec(&renewed).unwrap(),
        )
        .await;
        hostile.push((case, seq, entity));
    }
    let renewals = i64::try_from(hostile.len()).unwrap();
    wait_until("every renewal applied", WAIT, || async {
        count(
            &world.db.pool,
            "select count(*) from applied where kind = 'subscription.renewed'",
        )
        .await
            == renewals
    })
    .await
    .unwrap();
    support::wait_acked(&world.js, STREAM, "ordered", WAIT).await;
    for (case, seq, entity) in &hostile {
        let settled_at: chrono::DateTime<chrono::Utc> = match case.outcome {
            Outcome::Handled => sqlx::query_scalar(
                "select applied_at from applied where entity = $1 and kind = 'subscription.created'",
            )
            .bind(entity)
            .fetch_one(&world.db.pool)
            .await
            .unwrap_or_else(|e| panic!("{}: not applied: {e}", case.name)),
            Outcome::Dead(_) => sqlx::query_scalar(
                "select created_at from inbox_dead_letters where consumer = 'ordered' and stream_sequence = $1",
            )
            .bind(i64::try_from(*seq).unwrap())
            .fetch_one(&world.db.pool)
            .await
            .unwrap_or_else(|e| panic!("{}: no dead letter: {e}", case.name)),
        };
        let renewed_at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
            "select applied_at from applied where entity = $1 and kind = 'subscription.renewed'",
        )
        .bind(entity)
        .fetch_one(&world.db.pool)
        .await
        .unwrap();
        assert!(
            renewed_at > settled_at,
            "{}: the renewal was applied at {renewed_at}, before its entity's earlier event was settled at {settled_at}",
            case.name
        );
    }
    stop.cancel();
    consumer.await.unwrap().unwrap();
}

/// The relay's audit reads its rows back from the stream, through the
/// client too: a message no client can read among them (published raw by
/// another client on the relay's subjects) costs it at most one dropped
/// connection, not one every audit pass; every row is published and checked.
#[tokio::test(flavor = "multi_thread")]
async fn the_relay_s_audit_reads_past_a_message_no_client_can_read() {
    let pg = blocking(PgServer::start).unwrap();
    let db = TestDb::on(&pg).await.unwrap();
    let nats: NatsServer = blocking(NatsServer::start).unwrap();
    outbox_pg::migrate(&db.pool).await.unwrap();
    let log_dir = std::env::temp_dir()
        .join("outbox-hostile")
        .join(format!("relay-{}", db.name()));
    std::fs::create_dir_all(&log_dir).unwrap();
    let metrics = support::http::free_addr();
    let mut relay = Program::new("relay", support::bin_dir().join("outbox-relay"), &log_dir)
        .env("DATABASE_URL", db.url())
        .env("NATS_URL", nats.url())
        .args(["--stream", STREAM, "--subjects", "subscription.>"])
        .args([
            "--duplicate-window",
            "5s",
            "--lease",
            "2s",
            "--publish-timeout",
            "1s",
        ])
        .args(["--audit-horizon", "10m"])
        .args(["--audit-interval", "300ms", "--poll-interval", "100ms"])
        .args(["--metrics-addr", &metrics.to_string()]);
    relay.start().await.unwrap();
    let log = || std::fs::read_to_string(log_dir.join("relay.log")).unwrap_or_default();
    let rows = |n: usize| {
        (0..n)
            .map(|i| {
                (
                    Uuid::now_v7(),
                    format!("relayed-{i}"),
                    json!({"subscription_id": format!("relayed-{i}"), "customer_id": "c1", "amount_cents": 1}),
                )
            })
            .collect::<Vec<_>>()
    };
    let published = |n: i64| {
        let pool = db.pool.clone();
        async move {
            wait_until("the rows published", WAIT, || async {
                count(
                    &pool,
                    "select count(*) from outbox_events where published_at is not null",
                )
                .await
                    == n
            })
            .await
            .unwrap();
        }
    };
    support::insert_events(&db.pool, "subscription.created", &rows(20)).await;
    published(20).await;
    let mut raw = Raw::connect(&nats.url()).await;
    raw.publish(
        "subscription.created",
        &block(&[b"X-Note: a\nb"]),
        &created("foreign").1,
    )
    .await;
    support::insert_events(&db.pool, "subscription.created", &rows(20)).await;
    published(40).await;
    let checked = || async {
        let text = support::http::get(metrics, "/metrics", Duration::from_secs(10))
            .await
            .map(|(_, body)| body)
            .unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with("outbox_relay_audit_checked_total"))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>()
    };
    wait_until("all 40 rows audited", WAIT, || async {
        checked().await >= 40.0
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log()));
    // A few more passes over nothing new.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = log();
    let drops = log.matches("event: disconnected").count();
    assert!(drops <= 1, "{drops} dropped connections:\n{log}");
    assert!(relay.is_running(), "{log}");
    assert_eq!(relay.terminate().await, Some(0), "{log}");
    let _ = std::fs::remove_dir_all(&log_dir);
}
