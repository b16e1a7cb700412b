//! The stream changes under a running `outbox-relay`, as an operator changes
//! it: subjects added (`nats stream edit`, here the same JetStream API call
//! through async-nats), `max_msg_size` lowered, the stream deleted and
//! created again. The relay is the shipped binary, run as a child process;
//! rows are written by plain SQL, as a client in any language writes them.
//!
//! - A subject added while the relay runs: the new type's rows are
//!   published, with the binary's default flags, none parked and no attempt
//!   spent (a row that looks uncaptured makes the relay read the stream
//!   again at once).
//! - Rows of a type the stream does not capture wait, without losing
//!   attempts, however many times they are tried; once the subject is
//!   added they are published without `outboxctl retry`.
//! - Given `--subjects` the existing stream lacks, the relay refuses to start
//!   naming the `nats stream edit` command to run; `--add-subjects` adds them.
//! - The stream deleted, then created again: nothing is parked or touched
//!   while it is gone (one log line says so), and the rows are published
//!   once it is back. The relay does not create it again by itself.
//! - `max_msg_size` lowered below a row's size: that row is parked as too
//!   large, the rows of other subjects flow.
//! - The audit judges by the limits the stream has now: messages a
//!   `max_msgs` set after the audit was built discarded are not lost.
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use outbox_publisher::audit::Audit;
use outbox_testkit::{NatsHandle, Program, TestDb, nats, wait_until};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

/// One test's database, broker, stream name and relay logs.
struct World {
    db: TestDb,
    broker: NatsHandle,
    js: jetstream::Context,
    stream: String,
    log_dir: PathBuf,
}

impl World {
    async fn new(stream: &str) -> Self {
        let db = TestDb::new().await.unwrap();
        let broker = nats().unwrap();
        let unique = &db.name()[db.name().len() - 12..];
        let log_dir = std::env::temp_dir()
            .join("outbox-stream-changes")
            .join(db.name());
        std::fs::create_dir_all(&log_dir).unwrap();
        let client = async_nats::connect(broker.url()).await.unwrap();
        Self {
            stream: format!("{stream}_{unique}"),
            js: jetstream::new(client),
            db,
            broker,
            log_dir,
        }
    }

    fn pool(&self) -> &PgPool {
        &self.db.pool
    }

    /// `outbox-relay` on this world's database and stream with `args` after
    /// the connection settings; not started.
    fn relay(&self, name: &str, args: &[&str]) -> Program {
        Program::new(name, support::bin_dir().join("outbox-relay"), &self.log_dir)
            .env("DATABASE_URL", self.db.url())
            .env("NATS_URL", self.broker.url())
            .args(["--stream", self.stream.as_str()])
            .args(args.iter().copied())
    }

    /// `outbox-relay` with `args`, run to completion (bounded).
    async fn relay_output(&self, args: &[&str]) -> std::process::Output {
        let run = tokio::process::Command::new(support::bin_dir().join("outbox-relay"))
            .env("DATABASE_URL", self.db.url())
            .env("NATS_URL", self.broker.url())
            .env("RUST_LOG", "info")
            .args(["--stream", self.stream.as_str()])
            .args(args)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("outbox-relay exited within 60 s")
            .unwrap()
    }

    /// Waits for `check`; on time-out, fails with the rows left
    /// unpublished and the relay's log.
    async fn wait<F, Fut>(&self, what: &str, timeout: Duration, check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        if let Err(e) = wait_until(what, timeout, check).await {
            panic!(
                "{e}; {}; relay log:\n{}",
                self.describe_unpublished().await,
                self.log("relay")
            );
        }
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// The stream's config as the server has it now.
    async fn stream_config(&self) -> stream::Config {
        let mut stream = self.js.get_stream(&self.stream).await.unwrap();
        stream.info().await.unwrap().config.clone()
    }

    /// Edits the stream as `nats stream edit` does: a config update.
    async fn edit_stream(&self, edit: impl FnOnce(&mut stream::Config)) {
        let mut config = self.stream_config().await;
        edit(&mut config);
        self.js.update_stream(&config).await.unwrap();
    }

    async fn stream_messages(&self) -> u64 {
        match self.js.get_stream(&self.stream).await {
            Ok(mut stream) => stream.info().await.map_or(0, |i| i.state.messages),
            Err(_) => 0,
        }
    }

    async fn count(&self, condition: &str) -> i64 {
        support::count_where(self.pool(), condition).await
    }

    /// Rows not published: how many, and what the table says of them.
    async fn describe_unpublished(&self) -> String {
        let rows: Vec<(String, String, i32, Option<String>)> = sqlx::query_as(
            "select event_type, subject, attempts, last_error from outbox_events
              where published_at is null order by seq limit 5",
        )
        .fetch_all(self.pool())
        .await
        .unwrap();
        format!(
            "{} unpublished, e.g. {rows:?}",
            self.count("published_at is null").await
        )
    }
}

impl Drop for World {
    /// Keeps the relays' logs only when the test failed.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

/// Inserts one row per `(subject, data)` of `event_type`, in order, in one
/// statement; returns their ids.
async fn insert(pool: &PgPool, event_type: &str, rows: &[(String, Value)]) -> Vec<Uuid> {
    let rows: Vec<(Uuid, String, Value)> = rows
        .iter()
        .map(|(subject, data)| (Uuid::now_v7(), subject.clone(), data.clone()))
        .collect();
    support::insert_events(pool, event_type, &rows).await;
    rows.into_iter().map(|(id, ..)| id).collect()
}

/// `n` rows spread over `entities` subjects named `<prefix>-<i>`.
fn rows(prefix: &str, n: usize, entities: usize) -> Vec<(String, Value)> {
    (0..n)
        .map(|i| (format!("{prefix}-{}", i % entities), json!({ "n": i })))
        .collect()
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    outbox_testkit::free_port().unwrap()
}

/// The value of the Prometheus sample `series` on `/metrics` at `port`, 0
/// while it is not there (or the endpoint not up yet).
async fn metric(port: u16, series: &str) -> f64 {
    let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return 0.0;
    };
    let request = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if conn.write_all(request.as_bytes()).await.is_err() {
        return 0.0;
    }
    let mut body = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_string(&mut body)).await;
    body.lines()
        .filter_map(|line| line.strip_prefix(series))
        .filter_map(|rest| rest.trim().parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_added_while_the_relay_runs_is_published_with_nothing_parked() {
    let world = World::new("LIVE").await;
    // The binary's default flags: nothing shortened for the test.
    let mut relay = world.relay("relay", &["--subjects", "live.a.>"]);
    relay.start().await.unwrap();
    insert(world.pool(), "live.a.created", &rows("a", 5, 5)).await;
    world
        .wait("the relay publishes", Duration::from_secs(30), || async {
            world.count("published_at is null").await == 0
        })
        .await;

    // The operator adds a subject while the relay runs; a service writes
    // the new type.
    world
        .edit_stream(|c| c.subjects.push("live.b.>".into()))
        .await;
    insert(world.pool(), "live.b.created", &rows("b", 200, 200)).await;

    world
        .wait(
            "the new type's 200 rows published",
            Duration::from_secs(20),
            || async { world.count("published_at is null").await == 0 },
        )
        .await;
    assert_eq!(world.stream_messages().await, 205);
    // Not one row was refused: none parked, no attempt spent, no error left.
    assert_eq!(
        world
            .count("attempts > 0 or last_error is not null or next_attempt_at is not null")
            .await,
        0
    );
    assert!(
        relay.is_running() && !relay.died(),
        "{}",
        world.log("relay")
    );
    assert_eq!(relay.terminate().await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_the_stream_does_not_capture_wait_without_losing_attempts_then_flow() {
    let world = World::new("WAIT").await;
    let port = free_port();
    let metrics_addr = format!("127.0.0.1:{port}");
    // A low cap, so that "never parked" means something; the stream read
    // again every second, so the test takes seconds.
    let mut relay = world.relay(
        "relay",
        &[
            "--subjects",
            "wait.a.>",
            "--max-attempts",
            "3",
            "--stream-refresh",
            "1s",
            "--metrics-addr",
            &metrics_addr,
        ],
    );
    relay.start().await.unwrap();
    insert(world.pool(), "wait.a.created", &rows("a", 5, 5)).await;
    let waiting = insert(world.pool(), "wait.b.created", &rows("b", 50, 10)).await;

    // Each of the 10 subjects' first row is tried again and again (more
    // often than the cap), and refused as not captured each time.
    let series = r#"outbox_relay_publish_failures_total{reason="not_captured"}"#;
    world
        .wait(
            "uncaptured rows tried more often than the attempt cap",
            Duration::from_secs(30),
            || async { metric(port, series).await >= 10.0 * 4.0 },
        )
        .await;
    assert_eq!(world.count("published_at is null").await, 50);
    assert_eq!(
        world
            .count("published_at is null and event_type = 'wait.a.created'")
            .await,
        0
    );
    // Never parked, no attempt counted; the error says what to run.
    assert_eq!(
        world
            .count("attempts > 0 or not isfinite(next_attempt_at)")
            .await,
        0
    );
    let errors: Vec<String> =
        sqlx::query_scalar("select last_error from outbox_events where last_error is not null")
            .fetch_all(world.pool())
            .await
            .unwrap();
    assert_eq!(errors.len(), 10, "{errors:?}");
    let command = format!(
        "nats stream edit {} --subjects 'wait.a.>,wait.b.created'",
        world.stream
    );
    for error in &errors {
        assert!(error.starts_with("not_captured: "), "{error}");
        assert!(error.contains(&command), "{error}");
    }
    let log = world.log("relay");
    assert_eq!(
        log.matches("the stream does not capture this event type")
            .count(),
        1,
        "one warning per type:\n{log}"
    );

    // The operator adds the subject; nobody touches the rows.
    world
        .edit_stream(|c| c.subjects.push("wait.b.>".into()))
        .await;
    world
        .wait(
            "the waiting rows published",
            Duration::from_secs(15),
            || async { world.count("published_at is null").await == 0 },
        )
        .await;
    assert_eq!(world.stream_messages().await, 55);
    // In order per subject: each subject's rows were published in seq order.
    let disorder: i64 = sqlx::query_scalar(
        "select count(*) from (
           select published_at < lag(published_at) over (partition by subject order by seq) as back
             from outbox_events where id = any($1)) t where back",
    )
    .bind(&waiting)
    .fetch_one(world.pool())
    .await
    .unwrap();
    assert_eq!(disorder, 0);
    assert_eq!(relay.terminate().await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subjects_the_stream_lacks_are_named_with_the_command_or_added_when_asked() {
    let world = World::new("ORDERS").await;
    world
        .js
        .create_stream(stream::Config {
            name: world.stream.clone(),
            subjects: vec!["orders.>".into()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();
    insert(world.pool(), "order.created", &rows("o", 20, 4)).await;

    // A first `--subjects` that does not match the stream: refused, with
    // what to run.
    let out = world.relay_output(&["--subjects", "order.>"]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let command = format!(
        "nats stream edit {} --subjects 'orders.>,order.>'",
        world.stream
    );
    assert!(stderr.contains(&command), "{stderr}");
    assert!(stderr.contains("--add-subjects"), "{stderr}");
    assert!(stderr.contains("outboxctl retry --all-stuck"), "{stderr}");
    assert_eq!(world.stream_config().await.subjects, ["orders.>"]);
    // Nothing was tried, so nothing was spent.
    assert_eq!(
        world
            .count("attempts > 0 or published_at is not null")
            .await,
        0
    );

    // Asked to, the relay adds them itself, keeping the stream's own.
    let out = world
        .relay_output(&["--subjects", "order.>", "--add-subjects", "--once"])
        .await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("added the missing subjects"), "{stderr}");
    assert_eq!(
        world.stream_config().await.subjects,
        ["orders.>", "order.>"]
    );
    assert_eq!(world.count("published_at is null").await, 0, "{stderr}");
    assert_eq!(world.stream_messages().await, 20);

    // Subjects the stream already captures (through a wildcard) are not
    // missing: no refusal, nothing added.
    let out = world
        .relay_output(&["--subjects", "order.created,orders.>", "--once"])
        .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        world.stream_config().await.subjects,
        ["orders.>", "order.>"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_and_created_again_under_the_relay_costs_the_rows_nothing() {
    let world = World::new("GONE").await;
    let mut relay = world.relay("relay", &["--subjects", "gone.>"]);
    relay.start().await.unwrap();
    insert(world.pool(), "gone.created", &rows("g", 5, 5)).await;
    world
        .wait("the relay publishes", Duration::from_secs(30), || async {
            world.count("published_at is null").await == 0
        })
        .await;
    let config = world.stream_config().await;

    world.js.delete_stream(&world.stream).await.unwrap();
    insert(world.pool(), "gone.created", &rows("h", 30, 10)).await;
    world
        .wait(
            "the relay says the stream is gone",
            Duration::from_secs(20),
            || async { world.log("relay").contains("no longer exists") },
        )
        .await;
    // Not the rows' fault: untouched, in the main lane, no attempt spent.
    assert_eq!(world.count("published_at is null").await, 30);
    assert_eq!(
        world
            .count("attempts > 0 or last_error is not null or next_attempt_at is not null")
            .await,
        0
    );
    // Not recreated by the relay.
    assert!(world.js.get_stream(&world.stream).await.is_err());

    // The operator creates it again.
    world.js.create_stream(config).await.unwrap();
    world
        .wait(
            "the rows published into the new stream",
            Duration::from_secs(30),
            || async { world.count("published_at is null").await == 0 },
        )
        .await;
    assert_eq!(world.stream_messages().await, 30);
    assert_eq!(
        world.count("attempts > 0 or last_error is not null").await,
        0
    );
    let log = world.log("relay");
    assert_eq!(log.matches("no longer exists").count(), 1, "{log}");
    assert!(log.contains("exists again"), "{log}");
    assert!(relay.is_running() && !relay.died(), "{log}");
    assert_eq!(relay.terminate().await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_over_a_lowered_max_msg_size_is_parked_as_too_large_and_others_flow() {
    let world = World::new("SIZE").await;
    let mut relay = world.relay("relay", &["--subjects", "size.>"]);
    relay.start().await.unwrap();
    insert(world.pool(), "size.created", &rows("s", 5, 5)).await;
    world
        .wait("the relay publishes", Duration::from_secs(30), || async {
            world.count("published_at is null").await == 0
        })
        .await;

    world.edit_stream(|c| c.max_message_size = 4_096).await;
    let big = insert(
        world.pool(),
        "size.created",
        &[
            ("big".into(), json!({ "blob": "x".repeat(8_000) })),
            ("big".into(), json!({ "after": "big" })),
        ],
    )
    .await;
    insert(world.pool(), "size.created", &rows("small", 20, 10)).await;

    world
        .wait(
            "the large row parked and the others published",
            Duration::from_secs(20),
            || async {
                world.count("published_at is null").await == 2
                    && world.count("not isfinite(next_attempt_at)").await == 1
            },
        )
        .await;
    let (attempts, error): (i32, String) =
        sqlx::query_as("select attempts, last_error from outbox_events where id = $1")
            .bind(big[0])
            .fetch_one(world.pool())
            .await
            .unwrap();
    assert_eq!(attempts, 20, "parked at the cap at once");
    assert!(error.starts_with("too_large: "), "{error}");
    assert!(error.contains("max_msg_size of 4096"), "{error}");
    // Its follower waits behind it; every other row went out.
    let follower: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("select published_at from outbox_events where id = $1")
            .bind(big[1])
            .fetch_one(world.pool())
            .await
            .unwrap();
    assert!(follower.is_none());
    assert_eq!(world.stream_messages().await, 25);
    assert_eq!(relay.terminate().await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_judges_by_the_limits_the_stream_has_now() {
    let world = World::new("LIMITS").await;
    world
        .js
        .create_stream(stream::Config {
            name: world.stream.clone(),
            subjects: vec!["limits.>".into()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();
    // Five events, published and marked as the relay marks them.
    let ids = insert(world.pool(), "limits.created", &rows("l", 5, 5)).await;
    for id in &ids {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.to_string().as_str());
        let ack = world
            .js
            .publish_with_headers("limits.created", headers, "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
        sqlx::query(
            "update outbox_events
                set published_at = now() - interval '1 minute',
                    published_stream = $2, published_seq = $3
              where id = $1",
        )
        .bind(id)
        .bind(&ack.stream)
        .bind(i64::try_from(ack.sequence).unwrap())
        .execute(world.pool())
        .await
        .unwrap();
    }
    // Built while the stream has no limits.
    let audit = Audit::new(world.pool().clone(), world.js.clone(), &world.stream)
        .await
        .unwrap();
    // The operator caps the stream at 2 messages: the 3 oldest are discarded.
    world.edit_stream(|c| c.max_messages = 2).await;
    assert_eq!(world.stream_messages().await, 2);

    let now = chrono::Utc::now();
    let report = audit
        .run(now - chrono::Duration::hours(1), now, false, 100)
        .await
        .unwrap();
    assert_eq!(report.checked, 5, "{report:?}");
    assert_eq!(report.intact, 2, "{report:?}");
    assert_eq!(
        report.discarded, 3,
        "discarded by the new limit, not lost: {report:?}"
    );
    assert!(report.lost.is_empty(), "{report:?}");
}
