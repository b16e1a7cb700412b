//! The durability in force, stated at start by the shipped binaries against
//! a real nats-server and PostgreSQL:
//!
//! - `outbox-relay` logs one `durability:` line (stream replicas, storage,
//!   duplicate window, republish horizon = lease + publish timeout, audit
//!   horizon) and warns on each setting that can lose acknowledged events:
//!   1 replica, memory storage, the audit off;
//! - `outbox-relay --require-durable` refuses to start on them, exit status
//!   non-zero, naming each (replicas on an R1 file stream; memory storage and
//!   the audit off too when asked for);
//! - a stream whose duplicate window is not longer than the republish horizon
//!   is refused with or without it, and the statement names both;
//! - the `billing` consumer logs its stream's replicas and storage and its
//!   inbox retention against the redelivery window, and warns on 1 replica.
//!
//! The binaries are built by `scripts/test` before the tests run.

use std::time::Duration;

use outbox_testkit::{Program, TestDb, wait_until};

const WAIT: Duration = Duration::from_secs(30);

/// Runs `outbox-relay <args>` to its exit; returns (exit code, stderr).
async fn relay_exit(db: &TestDb, nats_url: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(super::support::bin_dir().join("outbox-relay"))
            .env("DATABASE_URL", db.url())
            .env("NATS_URL", nats_url)
            .env("RUST_LOG", "info")
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("outbox-relay exited within 60 s")
    .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn log_dir(db: &TestDb) -> std::path::PathBuf {
    let dir = std::env::temp_dir()
        .join("durability-tests")
        .join(db.name());
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn read(dir: &std::path::Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

/// The line of `log` holding `marker`.
fn line<'a>(log: &'a str, marker: &str) -> &'a str {
    log.lines()
        .find(|l| l.contains(marker))
        .unwrap_or_else(|| panic!("no line with {marker:?}:\n{log}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_durable_refuses_an_r1_stream_naming_replicas() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let (code, log) = relay_exit(
        &db,
        nats.url(),
        &[
            "--stream",
            "DUR_R1",
            "--subjects",
            "durr1.>",
            "--require-durable",
        ],
    )
    .await;
    assert_ne!(code, Some(0), "{log}");
    let refusal = line(&log, "refusing to start (require durable)");
    assert!(refusal.contains("ERROR"), "{refusal}");
    assert!(
        refusal.contains("stream `DUR_R1` has 1 replica"),
        "{refusal}"
    );
    // A file stream with the audit on: nothing else is named.
    assert!(!refusal.contains("memory"), "{refusal}");
    assert!(!refusal.contains("audit"), "{refusal}");
    // The statement came first.
    let statement = line(&log, "durability: stream replicas");
    assert!(statement.contains("replicas=1"), "{statement}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_durable_names_memory_storage_and_the_audit_off() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let (code, log) = relay_exit(
        &db,
        nats.url(),
        &[
            "--stream",
            "DUR_MEM",
            "--subjects",
            "durmem.>",
            "--stream-storage",
            "memory",
            "--audit-horizon",
            "0",
            "--require-durable",
        ],
    )
    .await;
    assert_ne!(code, Some(0), "{log}");
    let refusal = line(&log, "refusing to start (require durable)");
    for named in ["1 replica", "memory storage", "the audit is off"] {
        assert!(refusal.contains(named), "{named:?} not in {refusal}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_states_its_durability_and_warns_on_each_risk() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let dir = log_dir(&db);
    let mut relay = Program::new(
        "relay",
        super::support::bin_dir().join("outbox-relay"),
        &dir,
    )
    .env("DATABASE_URL", db.url())
    .env("NATS_URL", nats.url())
    .args(["--stream", "DUR_WARN", "--subjects", "durwarn.>"])
    .args(["--stream-storage", "memory", "--audit-horizon", "0"])
    .args(["--duplicate-window", "90s", "--lease", "20s"])
    .args(["--publish-timeout", "4s"]);
    relay.start().await.unwrap();
    wait_until("the relay to start", WAIT, || async {
        read(&dir, "relay").contains("outbox relay started")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", read(&dir, "relay")));
    let log = read(&dir, "relay");
    let statement = line(&log, "durability: stream replicas");
    assert!(statement.contains(" INFO "), "{statement}");
    for field in [
        "stream=DUR_WARN",
        "replicas=1",
        "storage=Memory",
        "duplicate_window=90s",
        "republish_horizon=24s",
        "audit_horizon=None",
        "require_durable=false",
    ] {
        assert!(statement.contains(field), "{field} not in {statement}");
    }
    for warning in [
        "the stream has 1 replica",
        "the stream keeps messages in memory",
        "the audit is off (audit horizon 0)",
    ] {
        let l = line(&log, warning);
        assert!(l.contains(" WARN "), "{l}");
    }
    assert!(!log.contains("duplicate window is not longer"), "{log}");
    assert_eq!(relay.terminate().await, Some(0));

    // The audit on, on a file stream: its horizon is stated, no audit warning.
    let mut relay = Program::new(
        "relay-audit",
        super::support::bin_dir().join("outbox-relay"),
        &dir,
    )
    .env("DATABASE_URL", db.url())
    .env("NATS_URL", nats.url())
    .args(["--stream", "DUR_AUDIT", "--subjects", "duraudit.>"]);
    relay.start().await.unwrap();
    wait_until("the second relay to start", WAIT, || async {
        read(&dir, "relay-audit").contains("outbox relay started")
    })
    .await
    .unwrap();
    let log = read(&dir, "relay-audit");
    let statement = line(&log, "durability: stream replicas");
    for field in [
        "storage=File",
        "duplicate_window=120s",
        "republish_horizon=35s",
        "audit_horizon=Some(900s)",
        "audit_from_age=150s",
    ] {
        assert!(statement.contains(field), "{field} not in {statement}");
    }
    assert!(!log.contains("the audit is off"), "{log}");
    assert!(!log.contains("in memory"), "{log}");
    assert_eq!(relay.terminate().await, Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_window_inside_the_republish_horizon_is_refused_and_named() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let (code, log) = relay_exit(
        &db,
        nats.url(),
        &[
            "--stream",
            "DUR_WINDOW",
            "--subjects",
            "durwin.>",
            "--duplicate-window",
            "10s",
        ],
    )
    .await;
    assert_ne!(code, Some(0), "{log}");
    let warning = line(
        &log,
        "the duplicate window is not longer than the republish horizon",
    );
    assert!(warning.contains("duplicate_window=10s"), "{warning}");
    assert!(warning.contains("republish_horizon=35s"), "{warning}");
    assert!(
        line(&log, "ERROR").contains("must be longer than the lease plus the publish timeout"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_states_retention_against_redelivery_and_the_streams_replicas() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    crate::support::billing_stream(nats.url(), "OUTBOX").await;
    let dir = log_dir(&db);
    let mut billing = Program::new("billing", super::support::bin_dir().join("billing"), &dir)
        .env("DATABASE_URL", db.url())
        .env("NATS_URL", nats.url())
        .args(["--stream", "OUTBOX", "--consumer", "billing", "--no-relay"])
        .ready_when("billing ready");
    billing.start().await.unwrap();
    let log = read(&dir, "billing");
    let statement = line(
        &log,
        "durability: stream replicas and storage; inbox retention",
    );
    for field in [
        "consumer=billing",
        "stream=OUTBOX",
        "replicas=1",
        "storage=File",
        "inbox_retention=",
        "redelivery_window=",
    ] {
        assert!(statement.contains(field), "{field} not in {statement}");
    }
    assert!(
        line(&log, "durability: the stream has 1 replica").contains(" WARN "),
        "{log}"
    );
    assert_eq!(
        billing.terminate().await,
        Some(0),
        "{}",
        read(&dir, "billing")
    );
    let _ = std::fs::remove_dir_all(&dir);
}
