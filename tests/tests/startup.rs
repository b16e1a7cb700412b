//! Replicas started together: every binary that prepares its database at
//! start-up, started twice at the same instant on a fresh, empty database, in
//! several rounds. Both processes must print their ready line, keep running
//! (they stop cleanly, exit 0, when asked), and leave the whole schema behind:
//! every embedded migration applied once, and the service's own tables.
//!
//! Two `billing` replicas started together on a new database used to lose
//! the race between their `create table if not exists invoices`: one exited 1
//! with `duplicate key value violates unique constraint
//! "pg_type_typname_nsp_index"`. Start-up schema steps now run one at a time
//! under `outbox_pg::migrate_with`'s advisory lock.
//!
//! `STARTUP_ROUNDS` sets the number of rounds (default 5). The binaries are
//! built by `scripts/test` (`cargo build --workspace --bins`) before the tests
//! run.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use outbox_pg::{ErrorKind, MIGRATION_LOCK};
use outbox_testkit::{NatsServer, Program, TestDb, create_database, wait_until};
use sqlx::PgPool;
use support::relation_exists as exists;
use uuid::Uuid;

/// Rounds per binary, each on a fresh database.
fn rounds() -> usize {
    std::env::var("STARTUP_ROUNDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(5)
}

/// The tables and indexes the embedded migrations create.
const LIBRARY_RELATIONS: &[&str] = &[
    "outbox_events",
    "outbox_events_seq",
    "outbox_events_shard_seq_idx",
    "inbox_events",
    "inbox_dead_letters",
    "inbox_leases",
];

/// Fresh, empty databases on the test binary's PostgreSQL server.
struct Databases {
    /// A migrated database, kept only for its server's URL.
    anchor: TestDb,
    log_dir: PathBuf,
}

impl Databases {
    async fn new(what: &str) -> Self {
        let anchor = TestDb::new().await.unwrap();
        let log_dir = std::env::temp_dir()
            .join("outbox-startup")
            .join(format!("{what}-{}", anchor.name()));
        std::fs::create_dir_all(&log_dir).unwrap();
        Self { anchor, log_dir }
    }

    /// A new database with nothing in it: no migration history, no tables.
    async fn empty(&self, what: &str, round: usize) -> (String, PgPool) {
        let name = format!("{}_{what}_{round}", self.anchor.name());
        let url = create_database(self.anchor.url(), &name).await.unwrap();
        let pool = PgPool::connect(&url).await.unwrap();
        assert!(
            !exists(&pool, outbox_pg::MIGRATION_TABLE).await,
            "{name} is not empty"
        );
        (url, pool)
    }
}

/// Every embedded migration applied exactly once and successfully, and every
/// relation in `LIBRARY_RELATIONS` and `app` present.
async fn assert_schema_complete(pool: &PgPool, app: &[&str], round: usize) {
    let expected: Vec<i64> = outbox_pg::MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .map(|m| m.version)
        .collect();
    let applied: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "select version from {} where success order by version",
        outbox_pg::MIGRATION_TABLE
    )))
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(applied, expected, "round {round}: applied migrations");
    for relation in LIBRARY_RELATIONS.iter().chain(app) {
        assert!(
            exists(pool, relation).await,
            "round {round}: `{relation}` is missing"
        );
    }
}

/// Starts both programs at the same instant (each spawns on its future's first
/// poll, and `join!` polls both at once) and waits, bounded by
/// `Program::start`'s 60 s, for both ready lines; a process that exits first
/// fails at once. Returns the names of those that did not become ready.
async fn start_together(a: &mut Program, b: &mut Program) -> Vec<String> {
    let (ra, rb) = tokio::join!(a.start(), b.start());
    [(&a.name, ra), (&b.name, rb)]
        .into_iter()
        .filter(|(_, r)| r.is_err())
        .map(|(name, _)| name.clone())
        .collect()
}

/// Both still running, then stopped with SIGTERM: each must exit 0.
async fn assert_running_then_stop(pair: [&mut Program; 2], log_dir: &Path, round: usize) {
    for p in pair {
        assert!(
            !p.died(),
            "round {round}: {} died after becoming ready:\n{}",
            p.name,
            support::log_tail(&log_dir.join(format!("{}.log", &p.name)))
        );
        let code = p.terminate().await;
        assert_eq!(
            code,
            Some(0),
            "round {round}: {} did not stop cleanly:\n{}",
            p.name,
            support::log_tail(&log_dir.join(format!("{}.log", &p.name)))
        );
    }
}

/// Runs `rounds()` rounds of `pair(round, database url)`, each on a fresh
/// database, and fails listing every round in which a process did not become
/// ready (so a run reports how often the race was lost, not only the first).
async fn run_rounds<F>(what: &str, app_relations: &[&str], mut pair: F)
where
    F: FnMut(&Databases, usize, &str) -> (Program, Program),
{
    let dbs = Databases::new(what).await;
    let rounds = rounds();
    let mut failed = Vec::new();
    for round in 1..=rounds {
        let (url, pool) = dbs.empty(what, round).await;
        let (mut a, mut b) = pair(&dbs, round, &url);
        let not_ready = start_together(&mut a, &mut b).await;
        if !not_ready.is_empty() {
            let logs: Vec<String> = not_ready
                .iter()
                .map(|name| {
                    format!(
                        "--- {name}:\n{}",
                        support::log_tail(&dbs.log_dir.join(format!("{}.log", name)))
                    )
                })
                .collect();
            eprintln!(
                "round {round}: not ready: {}\n{}",
                not_ready.join(", "),
                logs.join("\n")
            );
            failed.push(round);
            a.kill9().await;
            b.kill9().await;
            continue;
        }
        assert_schema_complete(&pool, app_relations, round).await;
        assert_running_then_stop([&mut a, &mut b], &dbs.log_dir, round).await;
        pool.close().await;
    }
    assert!(
        failed.is_empty(),
        "{what}: a replica failed at start-up in {} of {rounds} rounds ({failed:?}); logs in {}",
        failed.len(),
        dbs.log_dir.display()
    );
}

#[tokio::test]
async fn billing_replicas_started_together_on_a_fresh_database() {
    let nats = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    let nats_url = nats.url();
    let bin = support::bin_dir().join("billing");
    run_rounds(
        "billing",
        &["invoices", "invoices_subscription_id"],
        |dbs, round, url| {
            let replica = |i: usize| {
                Program::new(&format!("billing-{round}-{i}"), bin.clone(), &dbs.log_dir)
                    .env("DATABASE_URL", url)
                    .env("NATS_URL", &nats_url)
                    // A durable per round: each round's database has its own inbox.
                    .args(["--consumer", &format!("billing_{round}")])
                    .args(["--concurrency", "2"])
                    .ready_when("billing ready")
            };
            (replica(1), replica(2))
        },
    )
    .await;
}

#[tokio::test]
async fn subscriptions_replicas_started_together_on_a_fresh_database() {
    let bin = support::bin_dir().join("subscriptions");
    run_rounds("subscriptions", &["subscriptions"], |dbs, round, url| {
        let replica = |i: usize| {
            Program::new(
                &format!("subscriptions-{round}-{i}"),
                bin.clone(),
                &dbs.log_dir,
            )
            .env("DATABASE_URL", url)
            .args(["--listen", "127.0.0.1:0", "--no-relay"])
            .ready_when("listening on")
        };
        (replica(1), replica(2))
    })
    .await;
}

/// `outbox-relay` has no schema step: it expects the tables and, started on a
/// database without them, waits (logging the missing relation) instead of
/// exiting. Two relays started together on a fresh database, while two
/// service replicas run [`outbox_pg::migrate_with`] at the same instant,
/// must both stay up, agree on the stream (both create it if missing), and
/// publish the first event once the schema is there.
#[tokio::test]
async fn relay_replicas_started_together_with_the_migrating_services() {
    const APP_SQL: &str = "create table if not exists accounts (id text primary key);
                           create index if not exists accounts_id_idx on accounts (id)";
    let nats = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let bin = support::bin_dir().join("outbox-relay");
    let dbs = Databases::new("relay").await;
    for round in 1..=rounds() {
        let (url, pool) = dbs.empty("relay", round).await;
        // A stream per round, on subjects of its own (streams may not overlap).
        let stream = format!("STARTUP_{round}");
        let subject = format!("startup{round}.created");
        let replica = |i: usize| {
            Program::new(&format!("relay-{round}-{i}"), bin.clone(), &dbs.log_dir)
                .env("DATABASE_URL", &url)
                .env("NATS_URL", nats.url())
                .args([
                    "--stream",
                    &stream,
                    "--subjects",
                    &format!("startup{round}.>"),
                ])
                .args(["--poll-interval", "100ms"])
        };
        let (mut a, mut b) = (replica(1), replica(2));
        // The relays print no ready line: `start` returns once they are spawned.
        let (ra, rb, ma, mb) = tokio::join!(
            a.start(),
            b.start(),
            outbox_pg::migrate_with(&pool, APP_SQL),
            outbox_pg::migrate_with(&pool, APP_SQL),
        );
        ra.unwrap();
        rb.unwrap();
        ma.unwrap_or_else(|e| panic!("round {round}: first migrator: {e}"));
        mb.unwrap_or_else(|e| panic!("round {round}: second migrator: {e}"));
        assert_schema_complete(&pool, &["accounts", "accounts_id_idx"], round).await;

        sqlx::query(
            "insert into outbox_events (id, event_type, source, subject, time, data)
             values ($1, $2, 'startup-test', 'acct_1', now(), '{}'::jsonb)",
        )
        .bind(Uuid::now_v7())
        .bind(&subject)
        .execute(&pool)
        .await
        .unwrap();
        wait_until(
            &format!("round {round}: the event in stream {stream}"),
            Duration::from_secs(30),
            || {
                let js = js.clone();
                let stream = stream.clone();
                async move {
                    match js.get_stream(&stream).await {
                        Ok(mut s) => s.info().await.is_ok_and(|i| i.state.messages == 1),
                        Err(_) => false,
                    }
                }
            },
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{e}\n--- relay-{round}-1:\n{}\n--- relay-{round}-2:\n{}",
                support::log_tail(&dbs.log_dir.join(format!("{}.log", &a.name))),
                support::log_tail(&dbs.log_dir.join(format!("{}.log", &b.name)))
            )
        });
        assert_running_then_stop([&mut a, &mut b], &dbs.log_dir, round).await;
        pool.close().await;
    }
}

/// Sessions of this database holding or waiting for the migration lock.
async fn migration_lock_sessions(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_locks
          where locktype = 'advisory' and objsubid = 2
            and classid::text::bigint = $1 and objid::text::bigint = $2
            and database = (select oid from pg_database where datname = current_database())",
    )
    .bind(i64::from(MIGRATION_LOCK.0))
    .bind(i64::from(MIGRATION_LOCK.1))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The lock never outlives a start-up: not after a failing step, and not
/// after a caller that gave up waiting for it (its connection is closed, not
/// returned to the pool).
#[tokio::test]
async fn the_migration_lock_is_released_after_a_failure_or_a_cancelled_wait() {
    const APP_SQL: &str = "create table if not exists accounts (id text primary key)";
    let dbs = Databases::new("lock").await;
    let (_, pool) = dbs.empty("lock", 1).await;
    let none_left = || async { migration_lock_sessions(&pool).await == 0 };

    let err = outbox_pg::migrate_with(&pool, "create table broken (")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Database, "{err}");
    assert!(!exists(&pool, "broken").await);
    wait_until(
        "the failed migrator's lock released",
        Duration::from_secs(10),
        none_left,
    )
    .await
    .unwrap();

    // Held by someone else: a caller that gives up waiting leaves nothing behind.
    let mut holder = pool.acquire().await.unwrap();
    sqlx::query("select pg_advisory_lock($1, $2)")
        .bind(MIGRATION_LOCK.0)
        .bind(MIGRATION_LOCK.1)
        .execute(&mut *holder)
        .await
        .unwrap();
    let waited = tokio::time::timeout(
        Duration::from_millis(300),
        outbox_pg::migrate_with(&pool, APP_SQL),
    )
    .await;
    assert!(
        waited.is_err(),
        "migrated while the lock was held elsewhere"
    );
    sqlx::query("select pg_advisory_unlock($1, $2)")
        .bind(MIGRATION_LOCK.0)
        .bind(MIGRATION_LOCK.1)
        .execute(&mut *holder)
        .await
        .unwrap();
    drop(holder);
    wait_until(
        "the cancelled waiter gone",
        Duration::from_secs(10),
        none_left,
    )
    .await
    .unwrap();

    outbox_pg::migrate_with(&pool, APP_SQL).await.unwrap();
    assert_schema_complete(&pool, &["accounts"], 1).await;
    wait_until(
        "the migrator's lock released",
        Duration::from_secs(10),
        none_left,
    )
    .await
    .unwrap();
}

/// Each shipped binary's `--help` opens with what the program does (its own
/// `about`), not the doc comment of a flattened argument group.
#[test]
fn every_binary_s_help_starts_with_what_it_does() {
    let cases = [
        ("outbox-relay", "Relay outbox_events rows to NATS JetStream"),
        ("outboxctl", "Operate an outbox and its inboxes"),
        ("billing", "Billing consumer: one invoice per subscription"),
        ("subscriptions", "Subscriptions HTTP service"),
        ("quickstart", "The quickest real round trip"),
        ("outbox-demo", "Outbox + inbox end to end"),
    ];
    for (bin, about) in cases {
        let out = std::process::Command::new(support::bin_dir().join(bin))
            .arg("--help")
            .env_clear()
            .output()
            .unwrap_or_else(|e| panic!("{bin}: {e} (built by `cargo build --workspace --bins`)"));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{bin} --help: {}", out.status);
        let first = text.lines().next().unwrap_or_default();
        assert!(
            first.starts_with(about),
            "{bin} --help opens with {first:?}, not {about:?}"
        );
    }
}

/// `outbox-relay --threads` (and `OUTBOX_THREADS`) outside 1–1024 is refused
/// before the relay connects to anything, naming the flag.
#[test]
fn a_thread_count_of_zero_is_refused_naming_the_flag() {
    let by_flag = std::process::Command::new(support::bin_dir().join("outbox-relay"))
        .args(["--threads", "0"])
        .env_clear()
        .output()
        .unwrap();
    let by_env = std::process::Command::new(support::bin_dir().join("outbox-relay"))
        .env_clear()
        .env("OUTBOX_THREADS", "0")
        .output()
        .unwrap();
    for out in [by_flag, by_env] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("--threads"), "{stderr}");
    }
}

/// A binary that refuses to run says why in one plain line: its message and
/// causes, durations as an operator writes them, not Rust's `Debug` of the
/// error (`Error: "…1209600s…"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_at_start_is_one_plain_line_with_humane_durations() {
    let db = TestDb::new().await.unwrap();
    let nats = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    // 50,000 deliveries 30 s apart outlast the 14-day inbox retention window.
    let out = tokio::process::Command::new(support::bin_dir().join("billing"))
        .env_clear()
        .env("DATABASE_URL", db.url())
        .env("NATS_URL", nats.url())
        .args(["--consumer", "billing_refusal", "--max-deliver", "50000"])
        .args(["--ack-wait", "30s"])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .expect("billing did not exit within 60 s")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    // The error is the last line that is not a log record (a task's
    // shutdown may still log after it, each record led by its timestamp).
    let is_record = |line: &str| {
        line.get(..4)
            .is_some_and(|y| y.bytes().all(|b| b.is_ascii_digit()))
    };
    let last = stderr
        .lines()
        .rev()
        .find(|line| !is_record(line))
        .unwrap_or_default();
    assert!(last.starts_with("billing: "), "{stderr}");
    assert_eq!(
        stderr
            .lines()
            .filter(|l| l.starts_with("billing: "))
            .count(),
        1,
        "{stderr}"
    );
    assert!(last.contains("retention window 14d is shorter"), "{last}");
    for debug in ["Error(", "Error: \"", "\\\"", "1209600s"] {
        assert!(!last.contains(debug), "{debug} in {last}");
    }
}

/// The lines of `log` that are noise at start: a PostgreSQL notice
/// (`relation … already exists, skipping`, which sqlx logs at INFO), or a
/// server error's location in PostgreSQL's C source (`… at line 3655`).
fn start_noise(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| {
            l.contains("already exists, skipping")
                || l.contains("sqlx::postgres::notice")
                || l.split(" at line ")
                    .skip(1)
                    .any(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect()
}

/// A first start of `billing` and of `subscriptions` (their in-process
/// relays on, as shipped) on a fresh database, then a second on the migrated
/// one: no PostgreSQL notice, no C-source line number, nothing at WARN or
/// ERROR (but the single-server NATS's one replica), and one line saying what
/// the migrations did (applied every file, then up to date).
#[tokio::test]
async fn the_services_start_quietly_on_a_fresh_database_and_again_on_a_migrated_one() {
    let nats = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    let dbs = Databases::new("quiet").await;
    for (i, (bin, ready, args)) in [
        (
            "billing",
            "billing ready",
            vec!["--consumer", "billing_quiet"],
        ),
        (
            "subscriptions",
            "listening on",
            vec!["--listen", "127.0.0.1:0"],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let (url, pool) = dbs.empty("quiet", i).await;
        let total = outbox_pg::MIGRATOR.iter().count();
        for (run, said) in [
            (1, format!("outbox schema: applied {total} migrations")),
            (2, format!("outbox schema up to date ({total} migrations)")),
        ] {
            let name = format!("{bin}-quiet-{run}");
            let mut p = Program::new(&name, support::bin_dir().join(bin), &dbs.log_dir)
                .env("DATABASE_URL", &url)
                .env("NATS_URL", nats.url())
                .args(args.clone())
                .ready_when(ready);
            let log_path = dbs.log_dir.join(format!("{name}.log"));
            p.start()
                .await
                .unwrap_or_else(|e| panic!("{e}\n{}", support::log_tail(&log_path)));
            let code = p.terminate().await;
            let log = std::fs::read_to_string(&log_path).unwrap();
            assert_eq!(code, Some(0), "{log}");
            assert!(
                start_noise(&log).is_empty(),
                "{bin} run {run}: noise:\n{log}"
            );
            // The test's NATS is one server: a stream of 1 replica is warned
            // on, as it should be; nothing else is.
            let warned: Vec<&str> = log
                .lines()
                .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
                .filter(|l| !l.contains("the stream has 1 replica"))
                .collect();
            assert!(warned.is_empty(), "{bin} run {run}: {warned:?}:\n{log}");
            let migrations: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("outbox schema"))
                .collect();
            assert_eq!(migrations.len(), 1, "{bin} run {run}:\n{log}");
            assert!(
                migrations[0].contains(&said),
                "{bin} run {run}: not `{said}`:\n{log}"
            );
            assert!(
                migrations[0].contains("the service's schema SQL applied"),
                "{bin} run {run}:\n{log}"
            );
        }
        pool.close().await;
    }
}

/// A server error shown by the library carries no C-source location: sqlx's
/// text of a `PgDatabaseError` ends in ` at line N`, N a line of the server's
/// C file; `outbox_pg::db_error_text`, `Error::database` and `error_line`
/// leave it out and keep the SQL position.
#[tokio::test]
async fn a_server_error_names_no_line_of_the_server_s_c_source() {
    let db = TestDb::new().await.unwrap();
    let e = sqlx::query("select * from no_such_table")
        .execute(&db.pool)
        .await
        .unwrap_err();
    assert!(e.to_string().contains(" at line "), "sqlx's text: {e}");
    let text = outbox_pg::db_error_text(&e);
    assert_eq!(
        text,
        "error returned from database: relation \"no_such_table\" does not exist \
         (at character 15 of the statement)"
    );
    let err = outbox_pg::Error::<ErrorKind>::database("reading", e);
    assert!(start_noise(&err.to_string()).is_empty(), "{err}");
    let line = outbox_pg::error_line(&err);
    assert!(start_noise(&line).is_empty(), "{line}");
    assert!(line.contains("no_such_table"), "{line}");
}
