//! `outbox-relay --once` drains the table, not its share of the shards:
//! started three at a time (a cron job overlapping the last one), or beside a
//! running relay, each exits 0 only once every row due at its start is
//! published.

use std::time::Duration;

use super::{unpublished, write};
use outbox_testkit::{Program, TestDb};

const WAIT: Duration = Duration::from_secs(120);

fn relay(name: &str, db: &TestDb, nats: &str, stream: &str, dir: &std::path::Path) -> Program {
    Program::new(name, super::support::bin_dir().join("outbox-relay"), dir)
        .env("DATABASE_URL", db.url())
        .env("NATS_URL", nats)
        .args(["--stream", stream, "--subjects", "once.>"])
}

/// Waits for `program` to exit on its own; its exit code.
async fn exit_code(program: &mut Program) -> Option<i32> {
    program.wait_exit(WAIT).await
}

/// Three drains started together on 3,000 rows: all exit 0, and when the last
/// one has, no row is left unpublished.
#[tokio::test]
async fn three_drains_started_together_publish_every_row() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stream = format!("ONCE_{}", &db.name()[db.name().len() - 8..]);
    write(&db.pool, "once.step", 300, 3_000).await;
    let mut drains: Vec<Program> = (0..3)
        .map(|i| relay(&format!("once-{i}"), &db, nats.url(), &stream, dir.path()).arg("--once"))
        .collect();
    for drain in &mut drains {
        drain.start().await.unwrap();
    }
    for drain in &mut drains {
        let name = drain.name.clone();
        let code = exit_code(drain).await;
        let log = std::fs::read_to_string(dir.path().join(format!("{name}.log"))).unwrap();
        assert_eq!(code, Some(0), "{name}:\n{log}");
    }
    assert_eq!(unpublished(&db.pool).await, 0, "every row published");
}

/// A drain beside a long-running relay that holds most shards: it exits 0
/// once the rows of the other relay's shards are published too.
#[tokio::test]
async fn a_drain_beside_a_running_relay_waits_for_the_whole_table() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stream = format!("ONCE_{}", &db.name()[db.name().len() - 8..]);
    let mut running =
        relay("running", &db, nats.url(), &stream, dir.path()).args(["--workers", "4"]);
    running.start().await.unwrap();
    write(&db.pool, "once.step", 300, 3_000).await;
    let mut drain = relay("drain", &db, nats.url(), &stream, dir.path()).arg("--once");
    drain.start().await.unwrap();
    let code = exit_code(&mut drain).await;
    let log = std::fs::read_to_string(dir.path().join("drain.log")).unwrap();
    assert_eq!(code, Some(0), "{log}");
    assert_eq!(
        unpublished(&db.pool).await,
        0,
        "every row published when the drain exits"
    );
    assert_eq!(running.terminate().await, Some(0));
}
