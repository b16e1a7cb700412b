//! Behind PgBouncer (Debian's `pgbouncer`, started by the harness): writers
//! and migrations work through a transaction pool; the relay, `billing` and
//! `subscriptions` refuse one at start, naming it, and so does the consumer
//! library (`Consumer::new`, the builder); the relay runs through a session
//! pool.

use std::str::FromStr;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use inbox_consumer::{Consumer, ConsumerConfig};
use outbox_pg::{Envelope, Outbox};
use outbox_testkit::{PgBouncer, PoolMode, Program, TestDb, create_database, wait_until};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const WAIT: Duration = Duration::from_secs(60);

/// The port of the PostgreSQL server a test database lives on.
fn upstream_port(db: &TestDb) -> u16 {
    let after_host = db.url().split("127.0.0.1:").nth(1).unwrap();
    after_host.split('/').next().unwrap().parse().unwrap()
}

/// A pool through `bouncer` as a service behind PgBouncer 1.18 must make it:
/// unnamed statements only (no statement cache).
async fn pooled(bouncer: &PgBouncer, database: &str) -> PgPool {
    let options = PgConnectOptions::from_str(&bouncer.url("postgres", database))
        .unwrap()
        .statement_cache_capacity(0);
    PgPoolOptions::new()
        .max_connections(3)
        .connect_with(options)
        .await
        .unwrap()
}

/// Six services start at once on a fresh database through a transaction
/// pool: each migrates (twice, the second finding nothing to do) and
/// enqueues events in its own transactions. The schema is applied once, every
/// event is written, and no lock is left behind on the pooled sessions.
#[tokio::test]
async fn migrate_and_enqueue_through_a_transaction_pool_from_several_services_at_once() {
    let db = TestDb::new().await.unwrap();
    let name = format!("{}_pooled", db.name());
    create_database(db.url(), &name).await.unwrap();
    let bouncer = PgBouncer::start(upstream_port(&db), PoolMode::Transaction, &[]).unwrap();

    let services = (0..6).map(|service| {
        let bouncer = &bouncer;
        let name = name.clone();
        async move {
            let pool = pooled(bouncer, &name).await;
            for _ in 0..2 {
                outbox_pg::migrate(&pool).await.unwrap();
            }
            let outbox = Outbox::unvalidated().persistent(false);
            for n in 0..20 {
                let mut tx = pool.begin().await.unwrap();
                let event = Envelope::new(
                    "pool.step",
                    "tests",
                    format!("service_{service}"),
                    json!({"n": n}),
                )
                .unwrap();
                outbox.enqueue(&mut tx, &event).await.unwrap();
                tx.commit().await.unwrap();
            }
            pool.close().await;
        }
    });
    tokio::time::timeout(WAIT, futures::future::join_all(services))
        .await
        .unwrap_or_else(|_| panic!("migrate and enqueue did not finish\n{}", bouncer.log()));

    let direct = PgPool::connect(&db.url().replace(db.name(), &name))
        .await
        .unwrap();
    let (events, recorded, locks): (i64, i64, i64) = sqlx::query_as(
        "select (select count(*) from outbox_events),
                (select count(*) from outbox_schema_migrations where success),
                (select count(*) from pg_locks
                  where locktype = 'advisory'
                    and database = (select oid from pg_database where datname = current_database()))",
    )
    .fetch_one(&direct)
    .await
    .unwrap();
    assert_eq!(events, 120, "every event written once");
    assert_eq!(
        recorded,
        i64::try_from(outbox_pg::MIGRATOR.iter().count()).unwrap(),
        "each file recorded once"
    );
    assert_eq!(locks, 0, "no advisory lock left on a pooled session");
    direct.close().await;
}

/// The relay, `billing` and `subscriptions` given a transaction pool's URL
/// exit non-zero within seconds with one error naming the pooler and what to
/// do, before they publish, consume or serve anything.
#[tokio::test]
async fn the_binaries_refuse_a_transaction_pool_naming_it() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let bouncer = PgBouncer::start(upstream_port(&db), PoolMode::Transaction, &[]).unwrap();
    let url = bouncer.url("postgres", db.name());
    let log_dir = std::env::temp_dir().join("pooler-tests").join(db.name());
    std::fs::create_dir_all(&log_dir).unwrap();
    let unique = &db.name()[db.name().len() - 8..];
    let stream = format!("POOL_{unique}");
    let bin = super::support::bin_dir();
    let programs = [
        Program::new("outbox-relay", bin.join("outbox-relay"), &log_dir).args([
            "--stream",
            &stream,
            "--subjects",
            "pool.>",
        ]),
        Program::new("billing", bin.join("billing"), &log_dir).args([
            "--stream",
            &stream,
            "--metrics-addr",
            "127.0.0.1:0",
        ]),
        Program::new("subscriptions", bin.join("subscriptions"), &log_dir)
            .args(["--stream", &stream, "--listen", "127.0.0.1:0"])
            .args(["--metrics-addr", "127.0.0.1:0"]),
    ];
    for program in programs {
        let name = program.name.clone();
        let mut program = program
            .env("DATABASE_URL", url.clone())
            .env("NATS_URL", nats.url());
        let started = Instant::now();
        program.start().await.unwrap();
        wait_until(&format!("{name} exits"), WAIT, || {
            let died = program.died();
            async move { died }
        })
        .await
        .unwrap();
        let took = started.elapsed();
        let log = std::fs::read_to_string(log_dir.join(format!("{name}.log"))).unwrap();
        assert!(
            log.contains("pool_mode = transaction") && log.contains("pool_mode = session"),
            "{name} names the pooler and what to do:\n{log}"
        );
        assert!(
            !log.contains("sqlx_s_"),
            "{name} failed on a prepared statement before naming the pooler:\n{log}"
        );
        assert!(took < Duration::from_secs(20), "{name} took {took:?}");
    }
    let published: i64 =
        sqlx::query_scalar("select count(*) from outbox_events where published_at is not null")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(published, 0);
    let _ = std::fs::remove_dir_all(&log_dir);
}

/// `inbox_consumer::Consumer::new` and the builder, given a pool through a
/// transaction pool (as a service makes one: named prepared statements,
/// cached; another client's already prepared on the pooled session), refuse at once with
/// a configuration error naming the pooler and what to do, never a
/// `prepared statement … already exists` from a statement run before the
/// check; nothing is registered or created.
#[tokio::test]
async fn the_consumer_library_refuses_a_transaction_pool_naming_it() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let bouncer = PgBouncer::start(upstream_port(&db), PoolMode::Transaction, &[]).unwrap();
    let url = bouncer.url("postgres", db.name());
    // Another client of the pooler left a named statement on the pooled
    // session (sqlx's first is always `sqlx_s_1`): a named statement of the
    // consumer's pool landing there fails with "already exists".
    let other = PgPool::connect(&url).await.unwrap();
    let _: i32 = sqlx::query_scalar("select 1")
        .fetch_one(&other)
        .await
        .unwrap();
    let pool = PgPool::connect(&url).await.unwrap();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let stream = format!("POOLLIB_{}", &db.name()[db.name().len() - 8..]);
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec!["poollib.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();

    let started = Instant::now();
    let config = ConsumerConfig::new(&stream, "pooled").ordered(true);
    let direct = Consumer::new(pool.clone(), js.clone(), config)
        .await
        .unwrap_err();
    let built = Consumer::builder(pool.clone(), js.clone(), &stream, "pooled")
        .whole_stream()
        .stream_patience(Duration::from_secs(5))
        .run(std::future::pending::<()>())
        .await
        .unwrap_err();
    let took = started.elapsed();
    for (how, err) in [("Consumer::new", direct), ("the builder", built)] {
        assert_eq!(
            err.kind(),
            inbox_consumer::ErrorKind::Config,
            "{how}: {err}"
        );
        let text = err.to_string();
        for needle in [
            "consumer `pooled`",
            "pool_mode = transaction",
            "pool_mode = session",
            "the consumer runtime",
        ] {
            assert!(
                text.contains(needle),
                "{how} does not name `{needle}`: {text}"
            );
        }
        assert!(
            !text.contains("prepared statement") && !text.contains("sqlx_s_"),
            "{how} failed on a prepared statement before naming the pooler: {text}"
        );
    }
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let registered: i64 = sqlx::query_scalar("select count(*) from inbox_consumers")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(registered, 0, "nothing registered");
    other.close().await;
    let mut durables = js.get_stream(&stream).await.unwrap().consumer_names();
    assert!(
        futures::StreamExt::next(&mut durables).await.is_none(),
        "no durable created"
    );
    pool.close().await;
}

/// Through a session pool the relay holds its sessions, so it runs and
/// publishes every row: the check refuses transaction pooling only.
#[tokio::test]
async fn the_relay_runs_through_a_session_pool() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let bouncer = PgBouncer::start(upstream_port(&db), PoolMode::Session, &[]).unwrap();
    let log_dir = std::env::temp_dir().join("pooler-tests").join(db.name());
    std::fs::create_dir_all(&log_dir).unwrap();
    let unique = &db.name()[db.name().len() - 8..];
    let mut relay = Program::new(
        "outbox-relay",
        super::support::bin_dir().join("outbox-relay"),
        &log_dir,
    )
    .env("DATABASE_URL", bouncer.url("postgres", db.name()))
    .env("NATS_URL", nats.url())
    .args([
        "--stream",
        &format!("SESSION_{unique}"),
        "--subjects",
        "pool.>",
    ]);
    relay.start().await.unwrap();
    super::write(&db.pool, "pool.step", 10, 500).await;
    let drained = wait_until("every row published", WAIT, || async {
        super::unpublished(&db.pool).await == 0
    })
    .await;
    let log = std::fs::read_to_string(log_dir.join("outbox-relay.log")).unwrap_or_default();
    assert!(drained.is_ok(), "{drained:?}\n{log}");
    assert_eq!(relay.terminate().await, Some(0), "{log}");
    let _ = std::fs::remove_dir_all(&log_dir);
}

/// `--source wal` behind a session pool: PgBouncer does not carry the
/// replication protocol, so the relay given only the pool's URL exits
/// non-zero within seconds naming `--wal-url`, never backfilling and then
/// stalling; given `--wal-url` with the server's own address beside the
/// pool's URL, it reads the WAL and publishes every row.
#[tokio::test]
async fn the_wal_relay_behind_a_pooler_reads_the_wal_from_the_server_itself() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let bouncer = PgBouncer::start(upstream_port(&db), PoolMode::Session, &[]).unwrap();
    let log_dir = std::env::temp_dir().join("pooler-tests").join(db.name());
    std::fs::create_dir_all(&log_dir).unwrap();
    let unique = &db.name()[db.name().len() - 8..];
    let relay = |name: &str| {
        Program::new(
            name,
            super::support::bin_dir().join("outbox-relay"),
            &log_dir,
        )
        .env("DATABASE_URL", bouncer.url("postgres", db.name()))
        .env("NATS_URL", nats.url())
        .args(["--stream", &format!("WALPOOL_{unique}")])
        .args(["--subjects", "pool.>", "--source", "wal"])
    };
    let log = |name: &str| {
        std::fs::read_to_string(log_dir.join(format!("{name}.log"))).unwrap_or_default()
    };

    let mut refused = relay("pool-only");
    let started = Instant::now();
    refused.start().await.unwrap();
    wait_until("the relay exits", WAIT, || {
        let died = refused.died();
        async move { died }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log("pool-only")));
    assert!(
        log("pool-only").contains("--wal-url"),
        "the relay names what to do:\n{}",
        log("pool-only")
    );
    assert!(started.elapsed() < Duration::from_secs(20));

    let mut relay = relay("wal-url").env("OUTBOX_WAL_URL", db.url());
    relay.start().await.unwrap();
    wait_until("the relay reads the WAL", WAIT, || async {
        log("wal-url").contains("reading the WAL")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log("wal-url")));
    super::write(&db.pool, "pool.step", 10, 500).await;
    let drained = wait_until("every row published", WAIT, || async {
        super::unpublished(&db.pool).await == 0
    })
    .await;
    assert!(drained.is_ok(), "{drained:?}\n{}", log("wal-url"));
    assert_eq!(relay.terminate().await, Some(0), "{}", log("wal-url"));
    super::support::wal::drop_slots(&db.pool).await;
    let _ = std::fs::remove_dir_all(&log_dir);
}
