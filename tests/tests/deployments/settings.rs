//! Settings that break the relay are refused at start, naming what to run:
//! an outbox the migrations never reached (or reached in part), a sequence
//! that caches, cycles or falls. Never "database unavailable", retried forever.

use std::time::{Duration, Instant};

use outbox_testkit::{Program, TestDb, create_database};

/// Runs `outbox-relay` on `url` until it exits on its own: its exit code, how
/// long it ran, and its log.
async fn run_relay(
    name: &str,
    url: &str,
    nats: &str,
    dir: &std::path::Path,
) -> (Option<i32>, Duration, String) {
    let mut relay = Program::new(name, super::support::bin_dir().join("outbox-relay"), dir)
        .env("DATABASE_URL", url)
        .env("NATS_URL", nats)
        .args([
            "--stream",
            &format!("SET_{name}"),
            "--subjects",
            &format!("{name}.>"),
        ]);
    let started = Instant::now();
    relay.start().await.unwrap();
    let code = relay.wait_exit(Duration::from_secs(90)).await;
    let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
    (code, started.elapsed(), log)
}

fn assert_refused(
    name: &str,
    (code, took, log): &(Option<i32>, Duration, String),
    needles: &[&str],
    within: Duration,
) {
    assert!(
        matches!(code, Some(c) if *c != 0),
        "{name} exits non-zero, got {code:?}:\n{log}"
    );
    assert!(*took < within, "{name} took {took:?}:\n{log}");
    for needle in needles {
        assert!(log.contains(needle), "{name} names `{needle}`:\n{log}");
    }
    assert!(
        !log.contains("database unavailable"),
        "{name} took a configuration error for an outage:\n{log}"
    );
}

/// A database the migrations never ran on, and one whose seq trigger is
/// disabled: each relay waits a while for the migrations, then exits
/// non-zero naming what is missing and what to run.
#[tokio::test]
async fn an_outbox_the_migrations_did_not_reach_is_named_with_what_to_run() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let bare = create_database(db.url(), &format!("{}_bare", db.name()))
        .await
        .unwrap();
    sqlx::query("alter table outbox_events disable trigger outbox_events_assign_seq")
        .execute(&db.pool)
        .await
        .unwrap();
    let (unmigrated, partial) = tokio::join!(
        run_relay("unmigrated", &bare, nats.url(), dir.path()),
        run_relay("partial", db.url(), nats.url(), dir.path()),
    );
    let within = Duration::from_secs(40);
    assert_refused(
        "unmigrated",
        &unmigrated,
        &["table outbox_events not found", "run the outbox migrations"],
        within,
    );
    assert_refused(
        "partial",
        &partial,
        &["outbox_events_assign_seq", "run the outbox migrations"],
        within,
    );
}

/// `alter sequence outbox_events_seq cache 20` (or `cycle`) would let a
/// session take seqs below those already committed, behind the cursors: the
/// relay refuses it at once, naming the statement that fixes it.
#[tokio::test]
async fn a_sequence_that_caches_or_cycles_is_refused_naming_the_fix() {
    let nats = outbox_testkit::nats().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (name, setting, named) in [
        (
            "cached",
            "cache 20",
            "alter sequence outbox_events_seq cache 1",
        ),
        (
            "cycling",
            "cycle",
            "alter sequence outbox_events_seq no cycle",
        ),
    ] {
        let db = TestDb::new().await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "alter sequence outbox_events_seq {setting}"
        )))
        .execute(&db.pool)
        .await
        .unwrap();
        let outcome = run_relay(name, db.url(), nats.url(), dir.path()).await;
        assert_refused(name, &outcome, &[named], Duration::from_secs(15));
    }
}

/// A consumer on a database the migrations never reached: after waiting a
/// while for them, one error naming the inbox tables and what to run, not a
/// retry of every message.
#[tokio::test]
async fn a_consumer_on_an_unmigrated_inbox_is_refused_naming_what_to_run() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "SET_INBOX".into(),
        subjects: vec!["setinbox.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let bare = create_database(db.url(), &format!("{}_bare_inbox", db.name()))
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect(&bare).await.unwrap();
    let started = Instant::now();
    let config = inbox_consumer::ConsumerConfig::new("SET_INBOX", "billing").ordered(true);
    let Err(err) = inbox_consumer::Consumer::new(pool, js, config).await else {
        panic!("a consumer started on a database without its tables");
    };
    assert_eq!(err.kind(), inbox_consumer::ErrorKind::Config, "{err}");
    let message = err.to_string();
    for needle in [
        "inbox_events",
        "inbox_dead_letters",
        "inbox_leases",
        "run the outbox migrations",
    ] {
        assert!(message.contains(needle), "{message}");
    }
    assert!(started.elapsed() < Duration::from_secs(40));
}
