//! `outbox-relay --source wal` as a process against real PostgreSQL
//! (`wal_level=logical`) and nats-server: rows written by plain SQL, the
//! outcome read back from the table and from the stream in stream order.
//!
//! - A backlog written before the slot existed and rows written after, from
//!   concurrent writers and two writers on one entity (the one that began
//!   first commits second): each event once, per subject in change order,
//!   every row marked with its stream position.
//! - The slot dropped by an operator while the relay runs, and while it is
//!   stopped: nothing lost, the relay back on the WAL.
//! - The leader killed -9 with a standby running: the standby takes over,
//!   each event once, in order.
//! - A row no relay can publish is parked and holds back only its subject.
//! - `wal_level=replica`: refused at start, naming the setting.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[allow(dead_code)] // this file runs the relay binary only
mod support;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use outbox_testkit::{Program, TestDb, nats, wait_until};
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
        let log_dir = std::env::temp_dir().join("outbox-wal-relay").join(db.name());
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
            .args(["--stream", &self.stream, "--subjects", "wal.>", "--source", "wal"])
            // Retry quickly in the poison test.
            .args(["--max-attempts", "2", "--backoff-base", "100ms", "--max-backoff", "200ms"])
    }

    async fn start(&self, name: &str) -> Program {
        let mut relay = self.program(name);
        relay.start().await.unwrap();
        relay
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.log_dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    fn tail(&self, name: &str) -> String {
        let log = self.log(name);
        let lines: Vec<&str> = log.lines().filter(|l| !l.contains("INFO async_nats")).collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Waits until every row is marked published and the stream holds
    /// `total` messages; panics with the relays' logs otherwise.
    async fn wait_all(&self, pool: &PgPool, total: i64, names: &[&str]) {
        let done = wait_until("every row published and marked", Duration::from_secs(120), || async {
            count_where(pool, "published_at is not null").await == total
                && stream_count(&self.nats_url, &self.stream).await == total as u64
        })
        .await;
        if let Err(e) = done {
            let published = count_where(pool, "published_at is not null").await;
            let stored = stream_count(&self.nats_url, &self.stream).await;
            let logs: Vec<String> = names
                .iter()
                .map(|n| format!("--- {n}:\n{}", self.tail(n)))
                .collect();
            panic!("{e}: {published} of {total} marked, {stored} stored\n{}", logs.join("\n"));
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
async fn write_spread(pool: &PgPool, prefix: &str, subjects: usize, rounds: i64, per: i64, first: i64) {
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

async fn count_where(pool: &PgPool, condition: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "select count(*) from outbox_events where {condition}"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn jetstream_client(url: &str) -> jetstream::Context {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(url)
        .await
        .unwrap();
    jetstream::new(client)
}

async fn stream_count(url: &str, stream: &str) -> u64 {
    let js = jetstream_client(url).await;
    let Ok(mut stream) = js.get_stream(stream).await else {
        return 0;
    };
    stream.info().await.map_or(0, |info| info.state.messages)
}

/// Every message of `stream` in stream order (its CloudEvents bodies).
async fn read_stream(url: &str, stream: &str) -> Vec<Value> {
    let js = jetstream_client(url).await;
    let mut stream = js.get_stream(stream).await.unwrap();
    let total = stream.info().await.unwrap().state.messages as usize;
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
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("reading the stream timed out")
            .unwrap()
            .unwrap();
        out.push(serde_json::from_slice(&message.payload).unwrap());
    }
    out
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
            problems.push(format!("{subject}: n {n} after {before}, sequence {sequence} after {seq_before}"));
        }
        last.insert(subject, (n, sequence));
    }
    assert!(problems.is_empty(), "{} problems, e.g. {:?}", problems.len(), &problems[..problems.len().min(5)]);
}

/// Every published row carries its stream position.
async fn assert_positions(pool: &PgPool) {
    assert_eq!(
        count_where(pool, "published_at is not null and (published_stream is null or published_seq is null)").await,
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
    sqlx::query("insert into accounts values ('acct', 0)").execute(&db.pool).await.unwrap();
    let mut first = db.pool.begin().await.unwrap();
    sqlx::query("select 1").execute(&mut *first).await.unwrap();
    let mut second = db.pool.begin().await.unwrap();
    // The later one locks the entity row and commits first; the earlier one
    // then makes the next change.
    for mut tx in [second, first] {
        let n: i64 = sqlx::query_scalar("update accounts set n = n + 1 where id = 'acct' returning n - 1")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        insert(&mut *tx, "entity", n, 1).await;
        tx.commit().await.unwrap();
    }
    write_spread(&db.pool, "live", 100, 5, 6, 0).await;
    let total = 20 * 2 * 10 + 2 + 100 * 5 * 6;
    relays.wait_all(&db.pool, total, &["wal-1"]).await;
    assert!(relay.is_running() && !relay.died(), "{}", relays.tail("wal-1"));
    let messages = read_stream(nats.url(), &relays.stream).await;
    assert_once_in_order(&messages);
    assert_positions(&db.pool).await;
    let log = relays.log("wal-1");
    assert!(log.contains("reading the WAL"), "{}", relays.tail("wal-1"));
    let slot = slot_of(&db.pool).await.expect("a replication slot");
    assert!(slot.0.starts_with("outbox_relay_"), "{slot:?}");
    assert_eq!(relay.terminate().await, Some(0), "{}", relays.tail("wal-1"));
}
