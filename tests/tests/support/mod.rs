//! Runs the workspace's binaries as a user would, and the helpers the test
//! binaries share (counts, the stream, logs).
#![allow(dead_code)] // each test binary uses what it needs

#[allow(dead_code)] // each test binary uses what it needs
pub(crate) mod http;
#[allow(dead_code)] // the tests that run a WAL relay use it
pub(crate) mod wal;

use std::path::PathBuf;
use std::process::Command;

/// What a finished process printed.
pub(crate) struct Output {
    pub(crate) status: std::process::ExitStatus,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

/// The directory holding the workspace's binaries (`target/debug`), next to
/// this test executable's `deps/`.
pub(crate) fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf();
    for bin in ["outbox-demo", "subscriptions", "billing", "outbox-relay"] {
        assert!(
            dir.join(bin).is_file(),
            "{} is missing: build the binaries first with `cargo build --workspace --bins` (scripts/test does)",
            dir.join(bin).display()
        );
    }
    dir
}

/// Runs `outbox-demo` with `args` to completion.
pub(crate) fn demo(args: &[&str]) -> Output {
    let dir = bin_dir();
    let out = Command::new(dir.join("outbox-demo"))
        .args(args)
        .arg("--bin-dir")
        .arg(&dir)
        .env_remove("DATABASE_URL")
        .env_remove("NATS_URL")
        .output()
        .unwrap();
    Output {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The one number `sql` selects (a `count(*)`), on `pool`.
pub(crate) async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Rows of `outbox_events` where `condition` holds.
pub(crate) async fn count_where(pool: &sqlx::PgPool, condition: &str) -> i64 {
    count(
        pool,
        &format!("select count(*) from outbox_events where {condition}"),
    )
    .await
}

/// A JetStream context on `url`, connecting however long the server takes
/// to come (back).
pub(crate) async fn jetstream_client(url: &str) -> async_nats::jetstream::Context {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(url)
        .await
        .unwrap();
    async_nats::jetstream::new(client)
}

/// A JetStream context on `url` with `stream` made as billing's relay would
/// make it (subjects `subscription.>` and `invoice.>`, defaults otherwise).
pub(crate) async fn billing_stream(url: &str, stream: &str) -> async_nats::jetstream::Context {
    let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.into(),
        subjects: vec!["subscription.>".into(), "invoice.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    js
}

/// Whether `relation` resolves through `pool`'s `search_path`.
pub(crate) async fn relation_exists(pool: &sqlx::PgPool, relation: &str) -> bool {
    sqlx::query_scalar::<_, bool>("select to_regclass($1) is not null")
        .bind(relation)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Messages in `stream` at `url`, 0 if it does not exist (yet).
pub(crate) async fn stream_count(url: &str, stream: &str) -> u64 {
    let js = jetstream_client(url).await;
    let Ok(mut stream) = js.get_stream(stream).await else {
        return 0;
    };
    stream.info().await.map_or(0, |info| info.state.messages)
}

/// The last 20 lines of the log at `path`, for a failure message, without
/// backtrace frames and the NATS client's reconnect chatter.
pub(crate) fn log_tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text
        .lines()
        .filter(|line| {
            let line = line.trim_start();
            let frame = line
                .split_once(": ")
                .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
            !frame && !line.starts_with("at ") && !line.contains("INFO async_nats")
        })
        .collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Runs blocking `f` (a server's start or kill) on this runtime worker.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// Every message of `stream` at `url`, in stream order, read through an
/// ordered consumer from the first; none if the stream is empty.
pub(crate) async fn stream_messages(
    url: &str,
    stream: &str,
) -> Vec<async_nats::jetstream::Message> {
    use async_nats::jetstream::consumer;
    use futures::StreamExt;

    let js = jetstream_client(url).await;
    let mut stream = js
        .get_stream(stream)
        .await
        .unwrap_or_else(|e| panic!("stream {stream} is missing: {e}"));
    let total = usize::try_from(stream.info().await.unwrap().state.messages).unwrap();
    if total == 0 {
        return Vec::new();
    }
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::with_capacity(total);
    while out.len() < total {
        let message = tokio::time::timeout(std::time::Duration::from_secs(10), messages.next())
            .await
            .expect("reading the stream timed out")
            .unwrap()
            .unwrap();
        out.push(message);
    }
    out
}

/// Panics, with the end of its log at `log`, unless `program` still runs.
pub(crate) fn assert_running(program: &mut outbox_testkit::Program, log: &std::path::Path) {
    assert!(
        program.is_running() && !program.died(),
        "{} exited; the end of its log ({}):\n{}",
        program.name,
        log.display(),
        log_tail(log)
    );
}

/// Inserts valid events as any SQL client would (source `sql-writer`) of `event_type`, one `(id, subject, data)` per row, in
/// one statement, in the given order.
pub(crate) async fn insert_events(
    pool: &sqlx::PgPool,
    event_type: &str,
    rows: &[(uuid::Uuid, String, serde_json::Value)],
) {
    let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.0).collect();
    let subjects: Vec<&str> = rows.iter().map(|r| r.1.as_str()).collect();
    let data: Vec<String> = rows.iter().map(|r| r.2.to_string()).collect();
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         select r.id, $1, 'sql-writer', r.subject, now(), r.data::jsonb
           from unnest($2::uuid[], $3::text[], $4::text[]) with ordinality
                as r(id, subject, data, position)
          order by r.position",
    )
    .bind(event_type)
    .bind(&ids)
    .bind(&subjects)
    .bind(&data)
    .execute(pool)
    .await
    .unwrap();
}

/// Publishes every event as the relay does (body: the envelope,
/// `Nats-Msg-Id`: its id), all acks in flight at once, then waits for them.
pub(crate) async fn publish_envelopes(
    js: &async_nats::jetstream::Context,
    events: &[outbox_pg::Envelope<serde_json::Value>],
) {
    let mut acks = Vec::with_capacity(events.len());
    for event in events {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", event.id().to_string().as_str());
        acks.push(
            js.publish_with_headers(
                event.event_type().as_str().to_owned(),
                headers,
                event.to_json().unwrap().into(),
            )
            .await
            .unwrap(),
        );
    }
    for ack in acks {
        ack.await.unwrap();
    }
}

/// Waits, up to `wait`, until `durable` of `stream` has nothing pending and
/// nothing unacked (both must exist by then).
pub(crate) async fn wait_acked(
    js: &async_nats::jetstream::Context,
    stream: &str,
    durable: &str,
    wait: std::time::Duration,
) {
    outbox_testkit::wait_until("every message acked", wait, || async {
        let Ok(stream) = js.get_stream(stream).await else {
            return false;
        };
        let Ok(info) = stream.consumer_info(durable).await else {
            return false;
        };
        info.num_pending == 0 && info.num_ack_pending == 0
    })
    .await
    .unwrap();
}
