//! docs/wire.md is what producers in other languages write: its example
//! message, published with Python's `nats-py` (installed into `.tools/venv`
//! by `scripts/setup`), is handled by the shipped `billing` run as a process.
//!
//! The example is taken from the page itself, its three fenced blocks found
//! by their info strings (`text wire-subject`, `text wire-headers`, `json
//! wire-body`), and published exactly as it stands: every run has a fresh
//! database and nats-server, so the page's fixed id is new to both. Then the
//! event has its inbox row and its invoice, the message is stored with the
//! page's headers, nothing is dead-lettered and nothing is left unacked.
//! And the other way: the example's event written as a row is published by
//! `outbox-relay` as the page says the relay writes it.
//!
//! The binaries are built by `scripts/test` before the tests run.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_nats::jetstream;
use outbox_pg::Envelope;
use outbox_testkit::{NatsServer, Program, TestDb, wait_until};
use serde_json::Value;
use support::blocking;

const WAIT: Duration = Duration::from_secs(60);
const STREAM: &str = "OUTBOX";

/// The example message of docs/wire.md.
struct Example {
    subject: String,
    /// `Name: value` lines, as on the page.
    headers: Vec<(String, String)>,
    body: String,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The body of the fenced block of `doc` whose info string is `info`.
fn fenced(doc: &str, info: &str) -> String {
    let open = format!("```{info}\n");
    let (_, rest) = doc
        .split_once(&open)
        .unwrap_or_else(|| panic!("docs/wire.md has no block ```{info}"));
    let (body, _) = rest
        .split_once("\n```")
        .unwrap_or_else(|| panic!("the block ```{info} of docs/wire.md is not closed"));
    body.to_owned()
}

fn example() -> Example {
    let doc = std::fs::read_to_string(root().join("docs/wire.md")).unwrap();
    let headers = fenced(&doc, "text wire-headers")
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let (name, value) = line
                .split_once(':')
                .unwrap_or_else(|| panic!("header line without a colon: {line}"));
            (name.trim().to_owned(), value.trim().to_owned())
        })
        .collect();
    Example {
        subject: fenced(&doc, "text wire-subject").trim().to_owned(),
        headers,
        body: fenced(&doc, "json wire-body") + "\n",
    }
}

/// The Python with `nats-py` that `scripts/setup` installs: `NATS_PYTHON`,
/// else `.tools/venv/bin/python`.
fn python() -> PathBuf {
    let python = std::env::var_os("NATS_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".tools/venv/bin/python"));
    let works = std::process::Command::new(&python)
        .args(["-c", "import nats"])
        .output()
        .is_ok_and(|out| out.status.success());
    assert!(
        works,
        "{} cannot import nats (nats-py): run `. scripts/setup`, which installs it into .tools/venv \
         (or `pip install nats-py` and set NATS_PYTHON to that python)",
        python.display()
    );
    python
}

/// Publishes to JetStream with nats-py, as a producer in another language:
/// argv is the URL, the subject, a file of `Name: value` header lines and a
/// file holding the body; prints the PubAck.
const PUBLISH_PY: &str = r#"
import asyncio, sys
import nats

async def main():
    url, subject, headers_path, body_path = sys.argv[1:5]
    headers = {}
    with open(headers_path) as f:
        for line in f:
            if line.strip():
                name, value = line.split(":", 1)
                headers[name.strip()] = value.strip()
    with open(body_path, "rb") as f:
        body = f.read()
    nc = await nats.connect(url)
    ack = await nc.jetstream().publish(subject, body, headers=headers)
    print(f"stream={ack.stream} seq={ack.seq} duplicate={bool(ack.duplicate)}")
    await nc.close()

asyncio.run(main())
"#;

async fn publish_with_python(url: &str, example: &Example, dir: &Path) -> String {
    let script = dir.join("publish.py");
    std::fs::write(&script, PUBLISH_PY).unwrap();
    let headers: String = example
        .headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\n"))
        .collect();
    std::fs::write(dir.join("headers.txt"), headers).unwrap();
    std::fs::write(dir.join("body.json"), &example.body).unwrap();
    let out = tokio::process::Command::new(python())
        .arg(&script)
        .arg(url)
        .arg(&example.subject)
        .arg(dir.join("headers.txt"))
        .arg(dir.join("body.json"))
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "publishing with nats-py: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The first message `STREAM` stored, as the server holds it.
async fn first_stored(js: &jetstream::Context) -> jetstream::message::StreamMessage {
    js.get_stream(STREAM)
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_s_example_published_with_nats_py_is_handled_by_billing() {
    let example = example();
    // What the page says of it: subject = type, Nats-Msg-Id = id.
    let envelope = Envelope::<Value>::from_json(example.body.as_bytes()).unwrap();
    let id = envelope.id().to_string();
    assert_eq!(envelope.event_type().as_str(), example.subject);
    assert!(
        example
            .headers
            .iter()
            .any(|(name, value)| name == "Nats-Msg-Id" && *value == id),
        "the example's Nats-Msg-Id is its id: {:?}",
        example.headers
    );
    let data = envelope.data();
    let subscription = data["subscription_id"].as_str().unwrap().to_owned();

    let db = TestDb::new().await.unwrap();
    let nats: NatsServer = blocking(NatsServer::start).unwrap();
    let js = support::billing_stream(&nats.url(), STREAM).await;
    let dir = tempfile::Builder::new()
        .prefix("outbox-wire-")
        .tempdir()
        .unwrap();
    let mut billing = Program::new("billing", support::bin_dir().join("billing"), dir.path())
        .env("DATABASE_URL", db.url())
        .env("NATS_URL", nats.url())
        .args(["--stream", STREAM, "--consumer", "billing", "--no-relay"])
        .ready_when("billing ready");
    billing.start().await.unwrap();
    let log = || support::log_tail(&dir.path().join("billing.log"));

    let ack = publish_with_python(&nats.url(), &example, dir.path()).await;
    assert!(
        ack.starts_with(&format!("stream={STREAM} seq=1 duplicate=False")),
        "{ack}"
    );

    wait_until("the example's invoice", WAIT, || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from invoices where event_id = $1::uuid and subscription_id = $2",
        )
        .bind(&id)
        .bind(&subscription)
        .fetch_one(&db.pool)
        .await
        .unwrap()
            == 1
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log()));
    let (amount,): (i64,) =
        sqlx::query_as("select amount_cents from invoices where event_id = $1::uuid")
            .bind(&id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(amount, data["amount_cents"].as_i64().unwrap());
    let (event_type, subject, event_time): (String, String, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as(
            "select event_type, subject, event_time from inbox_events
              where consumer = 'billing' and event_id = $1::uuid",
        )
        .bind(&id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        (event_type.as_str(), subject.as_str(), event_time),
        (
            envelope.event_type().as_str(),
            envelope.subject(),
            envelope.time()
        )
    );
    assert_eq!(
        support::count(&db.pool, "select count(*) from inbox_dead_letters").await,
        0,
        "{}",
        log()
    );
    support::wait_acked(&js, STREAM, "billing", WAIT).await;

    // Stored as published: the page's headers, byte for byte the page's body.
    let stored = first_stored(&js).await;
    assert_eq!(stored.subject.as_str(), example.subject);
    assert_eq!(stored.payload.as_ref(), example.body.as_bytes());
    for (name, value) in &example.headers {
        assert_eq!(
            stored.headers.get(name.as_str()).map(|v| v.as_str()),
            Some(value.as_str()),
            "header {name}"
        );
    }

    support::assert_running(&mut billing, &dir.path().join("billing.log"));
    assert_eq!(billing.terminate().await, Some(0), "{}", log());
}

/// The other half of the page: the relay publishes the example's event,
/// written as a row of `outbox_events` with the example's trace context, as
/// the page says it does. The same subject and headers; the same body but
/// for the three differences the page names: one line, `sequence` (the
/// row's insert order, 1 in a fresh database), and the trace context in the
/// body as well.
#[tokio::test(flavor = "multi_thread")]
async fn the_relay_publishes_the_page_s_example_as_the_page_says() {
    let example = example();
    let body: Value = serde_json::from_str(&example.body).unwrap();
    let header = |name: &str| {
        example
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("the example has no {name} header"))
    };
    let db = TestDb::new().await.unwrap();
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data, traceparent, tracestate)
         values ($1::uuid, $2, $3, $4, $5::timestamptz, $6, $7, $8)",
    )
    .bind(body["id"].as_str().unwrap())
    .bind(body["type"].as_str().unwrap())
    .bind(body["source"].as_str().unwrap())
    .bind(body["subject"].as_str().unwrap())
    .bind(body["time"].as_str().unwrap())
    .bind(&body["data"])
    .bind(header("traceparent"))
    .bind(header("tracestate"))
    .execute(&db.pool)
    .await
    .unwrap();
    let nats: NatsServer = blocking(NatsServer::start).unwrap();
    let dir = tempfile::Builder::new()
        .prefix("outbox-wire-relay-")
        .tempdir()
        .unwrap();
    let mut relay = Program::new(
        "outbox-relay",
        support::bin_dir().join("outbox-relay"),
        dir.path(),
    )
    .env("DATABASE_URL", db.url())
    .env("NATS_URL", nats.url())
    .args(["--stream", STREAM, "--subjects", "subscription.>,invoice.>"]);
    relay.start().await.unwrap();
    let log = || support::log_tail(&dir.path().join("outbox-relay.log"));
    wait_until("the row published", WAIT, || async {
        support::count(
            &db.pool,
            "select count(*) from outbox_events where published_at is not null",
        )
        .await
            == 1
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log()));
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let stored = first_stored(&js).await;

    assert_eq!(stored.subject.as_str(), example.subject);
    let mut sent: Vec<(String, String)> = stored
        .headers
        .iter()
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |v| (name.to_string(), v.as_str().to_owned()))
        })
        .collect();
    sent.sort();
    let mut expected = example.headers.clone();
    expected.sort();
    assert_eq!(sent, expected, "the relay's headers are the page's");

    let payload = std::str::from_utf8(&stored.payload).unwrap();
    assert!(!payload.contains('\n'), "one line: {payload}");
    let published: Value = serde_json::from_str(payload).unwrap();
    let mut expected = body.clone();
    expected["sequence"] = "00000000000000000001".into();
    expected["traceparent"] = header("traceparent").into();
    expected["tracestate"] = header("tracestate").into();
    assert_eq!(
        published, expected,
        "the relay's body is the page's, plus its three differences"
    );
    assert_eq!(relay.terminate().await, Some(0), "{}", log());
}

/// The time forms docs/wire.md ("The time") says the consumer reads, and
/// those it says are refused.
#[test]
fn the_time_forms_the_page_names_are_read_or_refused_as_it_says() {
    let body = |time: &str| {
        format!(
            r#"{{"specversion":"1.0","id":"0193f0a4-5b6c-7d8e-9f01-23456789abcd","source":"s",
                "type":"a.b","subject":"x","time":{time},"data":null}}"#
        )
    };
    let utc = |s: &str| {
        chrono::DateTime::parse_from_rfc3339(s)
            .unwrap()
            .with_timezone(&chrono::Utc)
    };
    for (time, read) in [
        (r#""2026-12-01T10:00:00Z""#, "2026-12-01T10:00:00Z"),
        (r#""2026-12-01T11:00:00+01:00""#, "2026-12-01T10:00:00Z"),
        (
            r#""2026-12-01T10:00:00.123456789Z""#,
            "2026-12-01T10:00:00.123456Z",
        ),
        (r#""2026-12-01t10:00:00z""#, "2026-12-01T10:00:00Z"),
    ] {
        let env = Envelope::<Value>::from_json(body(time).as_bytes())
            .unwrap_or_else(|e| panic!("{time}: {e}"));
        assert_eq!(env.time(), utc(read), "{time}");
    }
    for time in [
        r#""2026-12-01T10:00:00""#,
        r#""2026-12-01""#,
        "1796119200",
        r#""10000-01-01T00:00:00Z""#,
    ] {
        assert!(
            Envelope::<Value>::from_json(body(time).as_bytes()).is_err(),
            "{time} is read"
        );
    }
    // The id: any UUID spelling, one value.
    for id in [
        "0193F0A4-5B6C-7D8E-9F01-23456789ABCD",
        "0193f0a45b6c7d8e9f0123456789abcd",
        "urn:uuid:0193f0a4-5b6c-7d8e-9f01-23456789abcd",
        "{0193f0a4-5b6c-7d8e-9f01-23456789abcd}",
    ] {
        let text =
            body(r#""2026-12-01T10:00:00Z""#).replace("0193f0a4-5b6c-7d8e-9f01-23456789abcd", id);
        let env = Envelope::<Value>::from_json(text.as_bytes()).unwrap();
        assert_eq!(env.id().to_string(), "0193f0a4-5b6c-7d8e-9f01-23456789abcd");
    }
}
