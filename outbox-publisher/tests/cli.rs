//! The `outbox-relay` binary, driven as an operator (or another program) would:
//! environment and flags in, exit codes, metrics and the stream out.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use outbox_pg::{Envelope, Outbox};
use outbox_testkit::{NatsServer, TestDb, nats, wait_until};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

async fn seed(db: &TestDb, n: usize) {
    let events: Vec<_> = (0..n)
        .map(|i| {
            Envelope::new(
                "orders.created",
                "cli-tests",
                format!("order_{}", i % 25),
                json!({"n": i}),
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
}

async fn unpublished(db: &TestDb) -> i64 {
    sqlx::query_scalar("select count(*) from outbox_events where published_at is null")
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

async fn stream_count(url: &str, stream: &str) -> u64 {
    let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
    js.get_stream(stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages
}

fn relay(db: &TestDb, nats_url: &str, stream: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env("DATABASE_URL", db.url())
        .env("NATS_URL", nats_url)
        .env("RUST_LOG", "warn")
        .args(["--stream", stream, "--subjects", "orders.>"])
        .args(extra)
        .stdin(Stdio::null());
    cmd
}

#[tokio::test]
async fn once_drains_the_table_and_exits_zero() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    seed(&db, 500).await;
    let out = relay(
        &db,
        broker.url(),
        "CLI_ONCE",
        &["--once", "--batch-size", "64"],
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(unpublished(&db).await, 0);
    assert_eq!(stream_count(broker.url(), "CLI_ONCE").await, 500);
}

#[tokio::test]
async fn metrics_addr_serves_prometheus_text_and_sigterm_exits_zero() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    seed(&db, 10).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = relay(&db, broker.url(), "CLI_METRICS", &["--metrics-addr", &addr])
        .spawn()
        .unwrap();
    let mut body = String::new();
    wait_until(
        "metrics with published events",
        Duration::from_secs(20),
        || {
            let fetched = http_get(&addr, "/metrics");
            let done = fetched.as_deref().is_some_and(|b| {
                b.contains("outbox_relay_published_total")
                    && b.contains("outbox_relay_backlog_rows")
            });
            if done {
                body = fetched.unwrap_or_default();
            }
            async move { done }
        },
    )
    .await
    .unwrap();
    assert!(
        body.contains("outbox_relay_published_total{event_type=\"orders.created\"} 10"),
        "{body}"
    );
    // Histograms of seconds are Prometheus histograms, with buckets.
    assert!(
        body.contains("# TYPE outbox_relay_publish_latency_seconds histogram")
            && body.contains("outbox_relay_publish_latency_seconds_bucket{le=\"0.005\"}"),
        "{body}"
    );
    assert!(body.contains("outbox_relay_broker_up 1"), "{body}");
    assert!(body.contains("outbox_relay_database_up 1"), "{body}");
    let health = http_get(&addr, "/healthz").unwrap_or_default();
    assert!(
        health.starts_with("HTTP/1.0 200") && health.ends_with("ok\n"),
        "{health}"
    );
    let ready = http_get(&addr, "/readyz").unwrap_or_default();
    assert!(
        ready.starts_with("HTTP/1.0 200") && ready.contains(r#""ready":true"#),
        "{ready}"
    );

    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0));
}

#[tokio::test]
async fn kill_9_mid_drain_loses_nothing_and_the_stream_stores_each_event_once() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    seed(&db, 3_000).await;
    let fast = [
        "--batch-size",
        "50",
        "--lease",
        "2s",
        "--publish-timeout",
        "500ms",
        "--poll-interval",
        "50ms",
    ];
    let mut first = relay(&db, broker.url(), "CLI_KILL", &fast).spawn().unwrap();
    wait_until(
        "the first relay publishes some",
        Duration::from_secs(20),
        || async { unpublished(&db).await < 2_900 },
    )
    .await
    .unwrap();
    first.kill().unwrap(); // SIGKILL: no chance to mark or release
    first.wait().unwrap();
    assert!(unpublished(&db).await > 0, "killed before the end");

    let mut second = relay(&db, broker.url(), "CLI_KILL", &fast).spawn().unwrap();
    wait_until(
        "the second relay finishes",
        Duration::from_secs(60),
        || async { unpublished(&db).await == 0 },
    )
    .await
    .unwrap();
    Command::new("kill")
        .args(["-TERM", &second.id().to_string()])
        .status()
        .unwrap();
    assert_eq!(
        wait_exit(&mut second, Duration::from_secs(10)).await.code(),
        Some(0)
    );
    assert_eq!(stream_count(broker.url(), "CLI_KILL").await, 3_000);
}

#[test]
fn invalid_flags_fail_with_a_message_naming_them() {
    let out = Command::new(BIN)
        .env("DATABASE_URL", "postgres://127.0.0.1:1/none")
        .args(["--batch-size", "0", "--once"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("batch size"), "{stderr}");

    let out = Command::new(BIN)
        .env_remove("DATABASE_URL")
        .arg("--once")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("DATABASE_URL"));
}

async fn wait_exit(child: &mut std::process::Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process did not exit within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response)
}

#[tokio::test]
async fn authenticates_with_a_user_and_password() {
    let db = TestDb::new().await.unwrap();
    let broker = NatsServer::start_with_args(&["--user", "relay", "--pass", "s3cret"]).unwrap();
    seed(&db, 20).await;
    let out = relay(&db, &broker.url(), "CLI_AUTH", &["--once"])
        .env("NATS_USER", "relay")
        .env("NATS_PASSWORD", "s3cret")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(unpublished(&db).await, 0);
    let client =
        async_nats::ConnectOptions::with_user_and_password("relay".into(), "s3cret".into())
            .connect(broker.url())
            .await
            .unwrap();
    let js = async_nats::jetstream::new(client);
    let count = js
        .get_stream("CLI_AUTH")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(count, 20);
}

/// A flag and the environment variable `--help` names for it.
type Flag = (String, Option<String>);

/// The flags `outbox-relay --help` lists (but `--help` and `--version`),
/// each with its environment variable.
fn help_flags() -> Vec<Flag> {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let mut flags: Vec<Flag> = Vec::new();
    for line in help.lines() {
        let option = line.trim_start();
        let indent = line.len() - option.len();
        if indent <= 6 && option.starts_with('-') {
            let long = option.split(' ').find(|word| word.starts_with("--"));
            let name = long.unwrap().trim_end_matches(',').to_owned();
            flags.push((name, None));
        } else if let Some(env) = option.strip_prefix("[env: ") {
            let env: String = env
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            flags.last_mut().unwrap().1 = Some(env);
        }
    }
    flags.retain(|(name, _)| name != "--help" && name != "--version");
    flags
}

/// The rows of docs/relay.md's flag table: the flags and the environment
/// variables its first column names.
fn documented_flags() -> Vec<(Vec<String>, Vec<String>)> {
    let doc = include_str!("../../docs/relay.md");
    let table = doc.split("## Flags").nth(1).unwrap();
    let table = table.split("\n## ").next().unwrap();
    table
        .lines()
        .filter(|line| line.starts_with("| `"))
        .map(|line| {
            let cell = line.split('|').nth(1).unwrap();
            let quoted: Vec<&str> = cell.split('`').skip(1).step_by(2).collect();
            let flags = quoted.iter().filter(|q| q.starts_with("--"));
            let envs = quoted
                .iter()
                .filter(|q| q.starts_with(|c: char| c.is_ascii_uppercase()));
            (
                flags.map(|f| (*f).to_owned()).collect(),
                envs.map(|e| (*e).to_owned()).collect(),
            )
        })
        .collect()
}

#[test]
fn every_flag_of_help_is_in_docs_relay_md_with_its_environment_variable_and_no_other() {
    let help = help_flags();
    assert!(help.len() > 40, "{help:?}");
    let rows = documented_flags();
    for (flag, env) in &help {
        let row = rows.iter().find(|(flags, _)| flags.contains(flag));
        let Some((_, envs)) = row else {
            panic!("{flag} is not in docs/relay.md's flag table");
        };
        if let Some(env) = env {
            assert!(
                envs.contains(env),
                "docs/relay.md's row of {flag} does not name {env}"
            );
        }
    }
    // Built without the `opentelemetry` feature, the binary has no exporter.
    let optional = ["--otlp-endpoint", "OTEL_EXPORTER_OTLP_ENDPOINT"];
    let known = |name: &String| {
        help.iter()
            .any(|(flag, env)| flag == name || env.as_ref() == Some(name))
            || (!cfg!(feature = "opentelemetry") && optional.contains(&name.as_str()))
    };
    for (flags, envs) in &rows {
        for name in flags.iter().chain(envs) {
            assert!(
                known(name),
                "docs/relay.md names {name}, which outbox-relay --help does not"
            );
        }
    }
}
