//! `outbox-relay --source wal` as a process against real PostgreSQL
//! (`wal_level=logical`) and nats-server: rows written by plain SQL, the
//! outcome read back from the table and from the stream in stream order.
//!
//! - A backlog written before the slot existed and 100,000 rows written
//!   after, from concurrent writers and two writers on one entity (the one that began
//!   first commits second): each event once, per subject in change order,
//!   every row marked with its stream position.
//! - The slot dropped by an operator while the relay runs, and while it is
//!   stopped: nothing lost, the relay back on the WAL.
//! - The leader killed -9 with a standby running: the standby takes over,
//!   each event once, in order.
//! - A row no relay can publish is parked and holds back only its subject.
//! - `wal_level=replica`: refused at start, naming the setting.
//! - PostgreSQL crashed mid-stream and the broker down for 30 s: each event
//!   once, no attempt burnt.
//! - An idle outbox holds no WAL back: the slot follows the server's WAL.
//! - `outboxctl wal status` shows the slot; `drop-slot` refuses it while read.
//! - `--threads 2` (a multi-threaded runtime, beside the default single
//!   thread): each event once, in order.

mod support;

use support::{count_where, stream_count};

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use outbox_testkit::{PgServer, Program, TestDb, nats, wait_until};
use serde_json::Value;
use sqlx::PgPool;

/// How to run `outbox-relay --source wal` against one test's database.
struct Relays {
    log_dir: PathBuf,
    database_url: String,
    nats_url: String,
    stream: String,
}

impl Relays {
    fn new(db: &TestDb, nats_url: &str) -> Self {
        let unique = &db.name()[db.name().len() - 12..];
        let log_dir = std::env::temp_dir()
            .join("outbox-wal-relay")
            .join(db.name());
        std::fs::create_dir_all(&log_dir).unwrap();
        Self {
            log_dir,
            database_url: db.url().to_owned(),
            nats_url: nats_url.to_owned(),
            stream: format!("WAL_{unique}"),
        }
    }

    fn program(&self, name: &str) -> Program {
        Program::new(name, support::bin_dir().join("outbox-relay"), &self.log_dir)
            .env("DATABASE_URL", &self.database_url)
            .env("NATS_URL", &self.nats_url)
            .args([
                "--stream",
                &self.stream,
                "--subjects",
                "wal.>",
                "--source",
                "wal",
            ])
            // Retry quickly in the poison test.
            .args([
                "--max-attempts",
                "2",
                "--backoff-base",
                "100ms",
                "--max-backoff",
                "200ms",
            ])
    }

    async fn start(&self, name: &str) -> Program {
        let mut relay = self.program(name);
        relay.start().await.unwrap();
        relay
    }

    /// Starts `name` and waits until it reads the WAL (its backfill done).
    async fn start_reading(&self, name: &str) -> Program {
        let relay = self.start(name).await;
        self.wait_logged(name, "reading the WAL").await;
        relay
    }

    /// Waits until `name` has logged `marker`; panics with its log otherwise.
    async fn wait_logged(&self, name: &str, marker: &str) {
        wait_until(
            &format!("{name} logs {marker:?}"),
            Duration::from_secs(30),
            || async { self.log(name).contains(marker) },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.tail(name)));
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    fn tail(&self, name: &str) -> String {
        let log = self.log(name);
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| !l.contains("INFO async_nats"))
            .collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Waits until every row is marked published and the stream holds
    /// `total` messages; panics with the relays' logs otherwise.
    async fn wait_all(&self, pool: &PgPool, total: i64, names: &[&str]) {
        let done = wait_until(
            "every row published and marked",
            Duration::from_secs(120),
            || async {
                count_where(pool, "published_at is not null").await == total
                    && stream_count(&self.nats_url, &self.stream).await == total as u64
            },
        )
        .await;
        if let Err(e) = done {
            let published = count_where(pool, "published_at is not null").await;
            let stored = stream_count(&self.nats_url, &self.stream).await;
            let logs: Vec<String> = names
                .iter()
                .map(|n| format!("--- {n}:\n{}", self.tail(n)))
                .collect();
            panic!(
                "{e}: {published} of {total} marked, {stored} stored\n{}\n--- sessions:\n{}",
                logs.join("\n"),
                sessions(pool).await
            );
        }
    }
}

impl Drop for Relays {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

/// The database's sessions in a transaction, with their last statement: what
/// a failed wait prints, so a session holding rows back names itself.
async fn sessions(pool: &PgPool) -> String {
    type Session = (
        i32,
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    );
    let rows: Vec<Session> = sqlx::query_as(
        "select pid, state, backend_xid::text, (now() - xact_start)::text, left(query, 300)
               from pg_stat_activity
              where datname = current_database() and xact_start is not null
                and pid <> pg_backend_pid()",
    )
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    rows.iter()
        .map(|r| format!("{r:?}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Inserts `n` events of `subject` with `data.n` from `first`, in one statement.
async fn insert<'e>(pool: impl sqlx::PgExecutor<'e>, subject: &str, first: i64, n: i64) {
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         select gen_random_uuid(), 'wal.happened', 'sql-writer', $1, now(), jsonb_build_object('n', i)
           from generate_series($2::bigint, $2::bigint + $3::bigint - 1) as i
          order by i",
    )
    .bind(subject)
    .bind(first)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

/// `rounds` transactions per subject, `per` events each, over `subjects`
/// subjects named `<prefix>-<i>`, written by 4 concurrent writers.
async fn write_spread(
    pool: &PgPool,
    prefix: &str,
    subjects: usize,
    rounds: i64,
    per: i64,
    first: i64,
) {
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let pool = pool.clone();
            let prefix = prefix.to_owned();
            tokio::spawn(async move {
                for round in 0..rounds {
                    for s in (w..subjects).step_by(4) {
                        insert(&pool, &format!("{prefix}-{s}"), first + round * per, per).await;
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
}

/// Every message of `stream` in stream order (its CloudEvents bodies).
async fn read_stream(url: &str, stream: &str) -> Vec<Value> {
    support::stream_messages(url, stream)
        .await
        .iter()
        .map(|message| serde_json::from_slice(&message.payload).unwrap())
        .collect()
}

/// Each event once, and per subject `data.n` rising by one from its first,
/// with `sequence` rising too.
fn assert_once_in_order(messages: &[Value]) {
    let mut seen = HashSet::new();
    let mut last: HashMap<String, (i64, String)> = HashMap::new();
    let mut problems = Vec::new();
    for m in messages {
        let id = m["id"].as_str().unwrap().to_owned();
        if !seen.insert(id.clone()) {
            problems.push(format!("{id} stored twice"));
        }
        let subject = m["subject"].as_str().unwrap().to_owned();
        let n = m["data"]["n"].as_i64().unwrap();
        let sequence = m["sequence"].as_str().unwrap().to_owned();
        if let Some((before, seq_before)) = last.get(&subject)
            && (n != before + 1 || sequence <= *seq_before)
        {
            problems.push(format!(
                "{subject}: n {n} after {before}, sequence {sequence} after {seq_before}"
            ));
        }
        last.insert(subject, (n, sequence));
    }
    assert!(
        problems.is_empty(),
        "{} problems, e.g. {:?}",
        problems.len(),
        &problems[..problems.len().min(5)]
    );
}

/// Every published row carries its stream position.
async fn assert_positions(pool: &PgPool) {
    assert_eq!(
        count_where(
            pool,
            "published_at is not null and (published_stream is null or published_seq is null)"
        )
        .await,
        0,
        "rows marked without their stream position"
    );
}

async fn slot_of(pool: &PgPool) -> Option<(String, bool)> {
    sqlx::query_as("select slot_name::text, active from pg_replication_slots where database = current_database()")
        .fetch_optional(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_and_concurrent_writers_are_published_once_in_change_order() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    // Written before any slot exists.
    write_spread(&db.pool, "backlog", 20, 2, 10, 0).await;
    let mut relay = relays.start("wal-1").await;
    // Two writers on one entity: the one that begins first commits second.
    sqlx::query("create table accounts (id text primary key, n bigint not null)")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("insert into accounts values ('acct', 0)")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut first = db.pool.begin().await.unwrap();
    sqlx::query("select 1").execute(&mut *first).await.unwrap();
    let second = db.pool.begin().await.unwrap();
    // The later one locks the entity row and commits first; the earlier one
    // then makes the next change.
    for mut tx in [second, first] {
        let n: i64 =
            sqlx::query_scalar("update accounts set n = n + 1 where id = 'acct' returning n - 1")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        insert(&mut *tx, "entity", n, 1).await;
        tx.commit().await.unwrap();
    }
    // 100,000 events over 1,000 subjects from 4 concurrent writers.
    write_spread(&db.pool, "live", 1_000, 10, 10, 0).await;
    let total = 20 * 2 * 10 + 2 + 1_000 * 10 * 10;
    relays.wait_all(&db.pool, total, &["wal-1"]).await;
    assert!(
        relay.is_running() && !relay.died(),
        "{}",
        relays.tail("wal-1")
    );
    let messages = read_stream(nats.url(), &relays.stream).await;
    assert_once_in_order(&messages);
    assert_positions(&db.pool).await;
    let log = relays.log("wal-1");
    assert!(log.contains("reading the WAL"), "{}", relays.tail("wal-1"));
    let slot = slot_of(&db.pool).await.expect("a replication slot");
    assert!(slot.0.starts_with("outbox_relay_"), "{slot:?}");

    // outboxctl shows the slot, and drops it only once nobody reads it.
    let status = outboxctl(db.url(), &["wal", "status"]);
    assert!(
        status.status.success() && status.stdout.contains(&slot.0),
        "{}{}",
        status.stdout,
        status.stderr
    );
    let refused = outboxctl(db.url(), &["wal", "drop-slot", &slot.0]);
    assert!(
        !refused.status.success() && refused.stderr.contains("being read"),
        "{}",
        refused.stderr
    );
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-1"));
    wait_until("the slot let go", Duration::from_secs(10), || async {
        slot_of(&db.pool).await.is_some_and(|(_, active)| !active)
    })
    .await
    .unwrap();
    let dropped = outboxctl(db.url(), &["wal", "drop-slot", &slot.0]);
    assert!(dropped.status.success(), "{}", dropped.stderr);
    assert!(slot_of(&db.pool).await.is_none());
}

/// The relay runs on one thread by default; `--threads N` runs it on N
/// worker threads beside the main one, and keeps every promise there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_several_threads_each_event_is_published_once_in_change_order() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    write_spread(&db.pool, "backlog", 10, 1, 10, 0).await;
    let mut relay = relays.program("wal-threads").args(["--threads", "2"]);
    relay.start().await.unwrap();
    relays.wait_logged("wal-threads", "reading the WAL").await;
    write_spread(&db.pool, "live", 200, 10, 10, 0).await;
    let total = 10 * 10 + 200 * 10 * 10;
    relays.wait_all(&db.pool, total, &["wal-threads"]).await;
    assert_once_in_order(&read_stream(nats.url(), &relays.stream).await);
    assert_positions(&db.pool).await;
    assert_eq!(
        relay.terminate().await,
        Some(0),
        "{}",
        relays.tail("wal-threads")
    );
}

/// `outboxctl` with `args`, against `url`.
fn outboxctl(url: &str, args: &[&str]) -> support::Output {
    let out = std::process::Command::new(support::bin_dir().join("outboxctl"))
        .env("DATABASE_URL", url)
        .args(args)
        .output()
        .unwrap();
    support::Output {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Drops the database's slot as an operator would: ends the walsender
/// reading it, then drops it (retried while the relay reconnects).
async fn drop_slot(pool: &PgPool) {
    wait_until("the slot dropped", Duration::from_secs(30), || async {
        let _ = sqlx::query(
            "select pg_terminate_backend(active_pid) from pg_replication_slots
              where database = current_database() and active_pid is not null",
        )
        .execute(pool)
        .await;
        sqlx::query(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots
              where database = current_database()",
        )
        .execute(pool)
        .await
        .is_ok()
            && slot_of(pool).await.is_none()
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_dropped_while_running_or_stopped_loses_nothing() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    let mut relay = relays.start("wal-1").await;
    write_spread(&db.pool, "a", 40, 2, 5, 0).await;
    relays.wait_all(&db.pool, 400, &["wal-1"]).await;

    // Dropped while it runs, with writers going on meanwhile.
    let writer = {
        let pool = db.pool.clone();
        tokio::spawn(async move { write_spread(&pool, "a", 40, 10, 5, 10).await })
    };
    drop_slot(&db.pool).await;
    writer.await.unwrap();
    relays.wait_all(&db.pool, 400 + 2_000, &["wal-1"]).await;
    wait_until(
        "the slot made again and read",
        Duration::from_secs(30),
        || async { slot_of(&db.pool).await.is_some_and(|(_, active)| active) },
    )
    .await
    .unwrap();
    assert!(
        relays.log("wal-1").contains("the replication slot is gone"),
        "{}",
        relays.tail("wal-1")
    );

    // Dropped while it is stopped, rows written meanwhile.
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-1"));
    drop_slot(&db.pool).await;
    write_spread(&db.pool, "a", 40, 1, 5, 60).await;
    let mut relay = relays.start("wal-2").await;
    write_spread(&db.pool, "a", 40, 1, 5, 65).await;
    relays
        .wait_all(&db.pool, 2_400 + 400, &["wal-1", "wal-2"])
        .await;
    let messages = read_stream(nats.url(), &relays.stream).await;
    assert_once_in_order(&messages);
    assert_positions(&db.pool).await;
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_standby_takes_over_from_a_killed_leader_in_order() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    let mut leader = relays.start_reading("wal-1").await;
    // One row per transaction, round after round over 40 subjects, until
    // the third kill is done.
    let writing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let writer = {
        let pool = db.pool.clone();
        let writing = writing.clone();
        tokio::spawn(async move {
            let mut rounds = 0;
            while writing.load(std::sync::atomic::Ordering::Relaxed) {
                write_spread(&pool, "k", 40, 1, 1, rounds).await;
                rounds += 1;
            }
            rounds
        })
    };
    let mut names = vec!["wal-1".to_owned()];
    for kill in 1..=3 {
        let standby = format!("wal-{}", kill + 1);
        let next = relays.start(&standby).await;
        relays.wait_logged(&standby, "standing by").await;
        let published = count_where(&db.pool, "published_at is not null").await;
        wait_until("more rows published", Duration::from_secs(60), || async {
            count_where(&db.pool, "published_at is not null").await >= published + 300
        })
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{e} (kill {kill}, {published} before)\n{}",
                relays.tail(names.last().map_or("wal-1", String::as_str))
            )
        });
        leader.kill9().await;
        relays.wait_logged(&standby, "reading the WAL").await;
        names.push(standby);
        leader = next;
    }
    writing.store(false, std::sync::atomic::Ordering::Relaxed);
    let rounds = writer.await.unwrap();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    relays.wait_all(&db.pool, rounds * 40, &names).await;
    let messages = read_stream(nats.url(), &relays.stream).await;
    assert_once_in_order(&messages);
    assert_positions(&db.pool).await;
    assert_eq!(
        leader.terminate().await,
        Some(0),
        "{}",
        relays.tail(names[3])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_poison_row_is_parked_and_holds_back_only_its_subject() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    let mut relay = relays.start_reading("wal-1").await;
    insert(&db.pool, "poisoned", 0, 3).await;
    // A time no CloudEvents client can carry, written by plain SQL.
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         values (gen_random_uuid(), 'wal.happened', 'sql-writer', 'poisoned', 'infinity', '{\"n\": 3}')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    insert(&db.pool, "poisoned", 4, 3).await;
    insert(&db.pool, "healthy", 0, 50).await;
    wait_until(
        "the healthy subject published, the poison parked",
        Duration::from_secs(60),
        || async {
            count_where(&db.pool, "subject = 'healthy' and published_at is not null").await == 50
                && count_where(
                    &db.pool,
                    "subject = 'poisoned' and published_at is not null",
                )
                .await
                    == 3
                && count_where(&db.pool, "attempts >= 2 and last_error like '%time%'").await == 1
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relays.tail("wal-1")));
    // The rows behind the poison wait in the retry lane, unpublished.
    wait_until(
        "the rows behind the poison deferred",
        Duration::from_secs(30),
        || async {
            count_where(
                &db.pool,
                "subject = 'poisoned' and published_at is null and next_attempt_at is not null",
            )
            .await
                == 4
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relays.tail("wal-1")));
    insert(&db.pool, "healthy", 50, 10).await;
    wait_until(
        "later rows of other subjects published",
        Duration::from_secs(30),
        || async {
            count_where(&db.pool, "subject = 'healthy' and published_at is not null").await == 60
        },
    )
    .await
    .unwrap();
    assert_eq!(stream_count(nats.url(), &relays.stream).await, 63);
    assert!(
        relay.is_running() && !relay.died(),
        "{}",
        relays.tail("wal-1")
    );
    let messages = read_stream(nats.url(), &relays.stream).await;
    assert_once_in_order(&messages);
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_level_replica_is_refused_at_start_naming_the_setting() {
    let server = tokio::task::spawn_blocking(|| PgServer::start_with(&["wal_level=replica"]))
        .await
        .unwrap()
        .unwrap();
    let db = TestDb::on(&server).await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    let mut relay = relays.start("wal-1").await;
    let code = relay.wait_exit(Duration::from_secs(30)).await;
    assert!(
        matches!(code, Some(c) if c != 0),
        "exit {code:?}: {}",
        relays.tail("wal-1")
    );
    let log = relays.log("wal-1");
    assert!(
        log.contains("wal_level=logical") && log.contains("wal_level=replica"),
        "{}",
        relays.tail("wal-1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_crashed_and_the_broker_down_mid_stream_store_each_event_once() {
    let mut pg = tokio::task::spawn_blocking(PgServer::start)
        .await
        .unwrap()
        .unwrap();
    let db = TestDb::on(&pg).await.unwrap();
    let mut broker = tokio::task::spawn_blocking(outbox_testkit::NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    let relays = Relays::new(&db, &broker.url());
    let mut relay = relays.start_reading("wal-1").await;
    write_spread(&db.pool, "p", 40, 2, 5, 0).await;
    relays.wait_all(&db.pool, 400, &["wal-1"]).await;

    // PostgreSQL crashes (immediate shutdown) right after more commits: the
    // slot may hand back transactions the relay published already.
    write_spread(&db.pool, "p", 40, 2, 5, 10).await;
    tokio::task::block_in_place(|| pg.restart()).unwrap();
    relays.wait_all(&db.pool, 800, &["wal-1"]).await;

    // The broker down for 30 s while rows are written: no attempt burnt.
    tokio::task::block_in_place(|| broker.kill()).unwrap();
    write_spread(&db.pool, "p", 40, 2, 5, 20).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(
        relay.is_running() && !relay.died(),
        "{}",
        relays.tail("wal-1")
    );
    assert_eq!(count_where(&db.pool, "published_at is not null").await, 800);
    tokio::task::block_in_place(|| broker.start_again()).unwrap();
    relays.wait_all(&db.pool, 1_200, &["wal-1"]).await;
    assert_eq!(
        count_where(&db.pool, "attempts > 0").await,
        0,
        "a broker outage cost attempts"
    );
    let messages = read_stream(&broker.url(), &relays.stream).await;
    assert_once_in_order(&messages);
    assert_positions(&db.pool).await;
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-1"));
}

/// A transaction left open in another database of the server holds a new
/// slot back (PostgreSQL starts a slot only once every transaction running
/// when it was asked for has ended): the relay names it, its database and
/// pid, instead of waiting in silence, and reads the WAL once it ends. On a
/// server of its own, so that nothing else here waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_held_back_by_a_transaction_elsewhere_names_it() {
    let pg = tokio::task::spawn_blocking(PgServer::start)
        .await
        .unwrap()
        .unwrap();
    let db = TestDb::on(&pg).await.unwrap();
    let other = TestDb::on(&pg).await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    let mut open = other.pool.begin().await.unwrap();
    insert(&mut *open, "elsewhere", 0, 1).await;
    let pid: i32 = sqlx::query_scalar("select pg_backend_pid()")
        .fetch_one(&mut *open)
        .await
        .unwrap();
    let mut relay = relays.start("wal-1").await;
    relays
        .wait_logged(
            "wal-1",
            "creating the replication slot waits for a transaction",
        )
        .await;
    let log = relays.log("wal-1");
    assert!(
        log.contains(&format!("pid={pid}")) && log.contains(other.name()),
        "{}",
        relays.tail("wal-1")
    );
    assert!(!log.contains("reading the WAL"), "{}", relays.tail("wal-1"));
    open.commit().await.unwrap();
    relays.wait_logged("wal-1", "reading the WAL").await;
    insert(&db.pool, "after", 0, 3).await;
    relays.wait_all(&db.pool, 3, &["wal-1"]).await;
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_outbox_does_not_hold_wal_back() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    let mut relay = relays.start_reading("wal-1").await;
    insert(&db.pool, "idle", 0, 5).await;
    relays.wait_all(&db.pool, 5, &["wal-1"]).await;
    // Other tables' writes move the server's WAL on; nothing of the outbox's.
    sqlx::query("create table elsewhere (n bigint)")
        .execute(&db.pool)
        .await
        .unwrap();
    let confirmed = || async {
        sqlx::query_scalar::<_, i64>(
            "select (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint from pg_replication_slots
              where database = current_database()",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    for _ in 0..20 {
        sqlx::query("insert into elsewhere select generate_series(1, 1000)")
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let written: i64 = sqlx::query_scalar("select (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    wait_until(
        "the slot confirmed past the other writes",
        Duration::from_secs(60),
        || async { confirmed().await >= written },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: WAL written up to {written}\n{}", relays.tail("wal-1")));
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-1"));
}

/// The WAL source's visibility check (`queries/wal_invisible.sql`): a
/// transaction that wrote to the outbox and has not ended is reported
/// invisible by its 32-bit id (as the replication stream names it); once it
/// committed, and for a transaction long over, nothing is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_visibility_check_reports_a_transaction_until_it_ends() {
    let db = TestDb::new().await.unwrap();
    let query = include_str!("../../outbox-publisher/queries/wal_invisible.sql");
    let invisible = |xid: i64| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(query)
                .bind(vec![xid])
                .fetch_all(&pool)
                .await
                .unwrap()
        }
    };
    let xid32 = "select (pg_current_xact_id()::text::bigint & 4294967295)";
    let mut tx = db.pool.begin().await.unwrap();
    insert(&mut *tx, "visibility", 0, 1).await;
    let open: i64 = sqlx::query_scalar(xid32).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(
        invisible(open).await,
        [open],
        "an open writer is not visible"
    );
    tx.commit().await.unwrap();
    assert!(
        invisible(open).await.is_empty(),
        "a committed writer is visible"
    );
    let mut conn = db.pool.acquire().await.unwrap();
    let old: i64 = sqlx::query_scalar(xid32)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    drop(conn);
    assert!(
        invisible(old).await.is_empty(),
        "an ended transaction is visible"
    );
}

/// A row made fresh again by plain SQL above the WAL's floor (an update,
/// which the WAL source does not read: here a parked row put back in the main
/// lane by hand) is found once the slot's confirmed position has passed it:
/// the relay says so, counts it, publishes it through the polling path and
/// reads the WAL again. Never a healthy relay with a row waiting for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_row_made_fresh_again_by_plain_sql_is_found_and_published() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    let metrics = support::http::free_addr();
    let mut relay = relays
        .program("wal-1")
        .args(["--metrics-addr", &metrics.to_string()]);
    relay.start().await.unwrap();
    relays.wait_logged("wal-1", "reading the WAL").await;
    // Parked from the start (attempts at the cap): neither path publishes it.
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data, attempts,
                                    next_attempt_at, last_error)
         values (gen_random_uuid(), 'wal.happened', 'sql-writer', 'by-hand', now(),
                 '{\"n\": 0}', 2, now(), 'imported parked')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    insert(&db.pool, "b", 0, 10).await;
    relays.wait_all(&db.pool, 10, &["wal-1"]).await;
    // Put back in the main lane by hand, as `outboxctl retry` does not.
    sqlx::query(
        "update outbox_events set attempts = 0, next_attempt_at = null, last_error = null
          where subject = 'by-hand'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Writes go on, so the slot's confirmed position moves past it.
    let mut n = 9;
    let found = wait_until(
        "the row made fresh by hand published",
        Duration::from_secs(90),
        || {
            n += 1;
            let pool = db.pool.clone();
            let first = n;
            async move {
                insert(&pool, "b", first, 1).await;
                count_where(&pool, "subject = 'by-hand' and published_at is not null").await == 1
            }
        },
    )
    .await;
    if let Err(e) = found {
        panic!("{e}\n{}", relays.tail("wal-1"));
    }
    let total = count_where(&db.pool, "true").await;
    relays.wait_all(&db.pool, total, &["wal-1"]).await;
    let log = relays.log("wal-1");
    assert!(
        log.contains("rows read from the WAL and confirmed are still unpublished"),
        "{}",
        relays.tail("wal-1")
    );
    // The backfill's line comes once the rows up to the new floor are out.
    wait_until(
        "the relay reading the WAL again after the backfill",
        Duration::from_secs(30),
        || async {
            relays
                .log("wal-1")
                .matches("through the polling path; reading the WAL")
                .count()
                >= 2
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relays.tail("wal-1")));
    let scraped = support::http::get(metrics, "/metrics", Duration::from_secs(10))
        .await
        .map(|(_, body)| body)
        .unwrap_or_default();
    assert!(
        scraped.contains("outbox_relay_wal_stranded_total 1"),
        "{scraped}"
    );
    // And it reads the WAL again: a new row goes that way.
    insert(&db.pool, "b", n + 1, 1).await;
    relays.wait_all(&db.pool, total + 1, &["wal-1"]).await;
    let messages = read_stream(nats.url(), &relays.stream).await;
    assert_once_in_order(&messages);
    assert_positions(&db.pool).await;
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-1"));
}

/// The log line of a backfill through the polling path.
const BACKFILLED: &str = "published through the polling path; reading the WAL";
/// The log line of a lead that catches up from the slot instead.
const CATCHING_UP: &str = "catching up from its confirmed position";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_relay_catches_up_from_the_slot_even_killed_mid_way() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    // A backlog before the slot: the first lead backfills it and records that.
    write_spread(&db.pool, "c", 200, 1, 5, 0).await;
    let mut relay = relays.start_reading("wal-1").await;
    assert!(
        relays.log("wal-1").contains(BACKFILLED),
        "{}",
        relays.tail("wal-1")
    );
    write_spread(&db.pool, "c", 200, 1, 5, 5).await;
    relays.wait_all(&db.pool, 2_000, &["wal-1"]).await;
    let recorded: i64 = sqlx::query_scalar("select count(*) from outbox_relay_slots")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(recorded, 1, "the backfill is recorded");

    // Killed while it publishes, 30,000 more rows written while it is down.
    let writer = {
        let pool = db.pool.clone();
        tokio::spawn(async move { write_spread(&pool, "c", 200, 30, 5, 10).await })
    };
    wait_until(
        "rows written after the first",
        Duration::from_secs(30),
        || async { count_where(&db.pool, "true").await >= 3_000 },
    )
    .await
    .unwrap();
    relay.kill9().await;
    writer.await.unwrap();
    let total = 2_000 + 30_000;

    // The next lead catches up from the slot, and is killed part way.
    let killed = count_where(&db.pool, "published_at is not null").await;
    let mut relay = relays.start("wal-2").await;
    relays.wait_logged("wal-2", CATCHING_UP).await;
    wait_until(
        "part of the rows published",
        Duration::from_secs(60),
        || async { count_where(&db.pool, "published_at is not null").await >= killed + 5_000 },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", relays.tail("wal-2")));
    relay.kill9().await;
    let published = count_where(&db.pool, "published_at is not null").await;
    assert!(
        published < total,
        "wal-2 was killed after it had caught up: make the backlog larger"
    );

    // And the one after catches up from where that one's outcomes put the slot.
    let mut relay = relays.start("wal-3").await;
    relays.wait_logged("wal-3", CATCHING_UP).await;
    relays
        .wait_all(&db.pool, total, &["wal-1", "wal-2", "wal-3"])
        .await;
    relays
        .wait_logged(
            "wal-3",
            "caught up with the WAL written before this session",
        )
        .await;
    for name in ["wal-2", "wal-3"] {
        assert!(
            !relays.log(name).contains(BACKFILLED),
            "{name} backfilled through the polling path:\n{}",
            relays.tail(name)
        );
    }
    let messages = read_stream(nats.url(), &relays.stream).await;
    assert_eq!(messages.len() as i64, total);
    assert_once_in_order(&messages);
    assert_positions(&db.pool).await;
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-3"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_without_a_recorded_backfill_is_backfilled_again() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    let mut relay = relays.start_reading("wal-1").await;
    write_spread(&db.pool, "b", 40, 1, 5, 0).await;
    relays.wait_all(&db.pool, 200, &["wal-1"]).await;
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-1"));
    // As a slot made by an older relay, or a backfill cut short, leaves it.
    sqlx::query("delete from outbox_relay_slots")
        .execute(&db.pool)
        .await
        .unwrap();
    write_spread(&db.pool, "b", 40, 1, 5, 5).await;
    let mut relay = relays.start_reading("wal-2").await;
    assert!(
        relays.log("wal-2").contains(BACKFILLED) && !relays.log("wal-2").contains(CATCHING_UP),
        "{}",
        relays.tail("wal-2")
    );
    write_spread(&db.pool, "b", 40, 1, 5, 10).await;
    relays.wait_all(&db.pool, 600, &["wal-1", "wal-2"]).await;
    let messages = read_stream(nats.url(), &relays.stream).await;
    assert_once_in_order(&messages);
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_backfill_table_the_relay_says_so_and_backfills_at_every_lead() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url());
    sqlx::query("drop table outbox_relay_slots")
        .execute(&db.pool)
        .await
        .unwrap();
    write_spread(&db.pool, "t", 40, 1, 5, 0).await;
    let mut relay = relays.start_reading("wal-1").await;
    relays.wait_all(&db.pool, 200, &["wal-1"]).await;
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-1"));
    write_spread(&db.pool, "t", 40, 1, 5, 5).await;
    let mut relay = relays.start_reading("wal-2").await;
    relays.wait_all(&db.pool, 400, &["wal-1", "wal-2"]).await;
    let log = relays.log("wal-2");
    assert!(
        log.contains(BACKFILLED) && !log.contains(CATCHING_UP),
        "{}",
        relays.tail("wal-2")
    );
    assert_eq!(
        log.matches("the relay cannot use outbox_relay_slots")
            .count(),
        1,
        "named once:\n{}",
        relays.tail("wal-2")
    );
    let messages = read_stream(nats.url(), &relays.stream).await;
    assert_once_in_order(&messages);
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-2"));
}
