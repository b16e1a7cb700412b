//! The shipped `outbox-relay` binary under faults, driven as an operator runs
//! it: relays are child processes, the rows are written by plain SQL (as a
//! client in any language writes them, without `outbox-pg`), and the
//! outcome is read back from the table and from the stream in stream order.
//!
//! - Per envelope `subject`, events reach the stream in insertion order, even
//!   when the transaction that began first commits last, and every message
//!   carries a zero-padded 20-digit `sequence` that increases per subject.
//! - A row that can never be published is parked (`attempts >= max_attempts`,
//!   `last_error` naming the fault) and blocks only its own subject; no relay
//!   process exits because of it.
//! - A broker that is down, or not started yet, never burns attempts, and a
//!   relay started without a broker waits for one.
//! - Four replicas drain a large backlog exactly once and in order per subject,
//!   with one of them killed mid-drain (two run on one thread, the default,
//!   two with `--threads 2`).
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

use super::support::{blocking, count, count_where, insert_events, jetstream_client, stream_count};

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use outbox_testkit::{NatsServer, Program, TestDb, nats, wait_until};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

// ---------------------------------------------------------------------------
// Relay processes.

/// How to run `outbox-relay` against one test's database and stream.
struct Relays {
    log_dir: PathBuf,
    database_url: String,
    nats_url: String,
    stream: String,
    subjects: String,
}

impl Relays {
    /// `stream` gets a unique suffix, so a shared `NATS_URL` server works too.
    fn new(db: &TestDb, nats_url: &str, stream: &str, subjects: &str) -> Self {
        let unique = &db.name()[db.name().len() - 12..];
        let log_dir = std::env::temp_dir()
            .join("outbox-relay-faults")
            .join(db.name());
        std::fs::create_dir_all(&log_dir).unwrap();
        Self {
            log_dir,
            database_url: db.url().to_owned(),
            nats_url: nats_url.to_owned(),
            stream: format!("{stream}_{unique}"),
            subjects: subjects.to_owned(),
        }
    }

    /// A relay in run mode with the default flags plus `extra`; not started.
    fn program(&self, name: &str, extra: &[&str]) -> Program {
        Program::new(
            name,
            super::support::bin_dir().join("outbox-relay"),
            &self.log_dir,
        )
        .env("DATABASE_URL", &self.database_url)
        .env("NATS_URL", &self.nats_url)
        .args(["--stream", &self.stream, "--subjects", &self.subjects])
        .args(extra.iter().copied())
    }

    /// Starts `n` replicas named `<prefix>-<i>`.
    async fn start(&self, prefix: &str, n: usize, extra: &[&str]) -> Vec<Program> {
        let mut replicas = Vec::with_capacity(n);
        for i in 1..=n {
            let mut relay = self.program(&format!("{prefix}-{i}"), extra);
            relay.start().await.unwrap();
            replicas.push(relay);
        }
        replicas
    }

    /// `outbox-relay --once` run to completion (bounded).
    async fn once(&self, extra: &[&str]) -> std::process::Output {
        let run = tokio::process::Command::new(super::support::bin_dir().join("outbox-relay"))
            .env("DATABASE_URL", &self.database_url)
            .env("NATS_URL", &self.nats_url)
            .env("RUST_LOG", "info")
            .args(["--stream", &self.stream, "--subjects", &self.subjects])
            .arg("--once")
            .args(extra)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        tokio::time::timeout(Duration::from_secs(120), run)
            .await
            .expect("outbox-relay --once finished within 120 s")
            .unwrap()
    }

    /// The last lines `name` logged that say what it did.
    fn log_tail(&self, name: &str) -> String {
        super::support::log_tail(&self.log_dir.join(format!("{name}.log")))
    }

    /// Panics with `error`, whether each relay still runs, and the end of
    /// each one's log.
    fn fail(&self, error: impl std::fmt::Display, replicas: &mut [Program]) -> ! {
        let report: Vec<String> = replicas
            .iter_mut()
            .map(|relay| {
                let running = relay.is_running() && !relay.died();
                format!(
                    "--- {} (running: {running}), end of its log:\n{}",
                    relay.name,
                    self.log_tail(&relay.name)
                )
            })
            .collect();
        panic!("{error}\n{}", report.join("\n"));
    }

    /// Panics, with its log, unless `relay` is still running.
    fn assert_running(&self, relay: &mut Program) {
        let log = self.log_dir.join(format!("{}.log", relay.name));
        super::support::assert_running(relay, &log);
    }
}

impl Drop for Relays {
    /// Keeps the relays' logs only when the test failed.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

// ---------------------------------------------------------------------------
// Rows, written as any SQL client would.

/// `n` new valid rows for `subject`, with `data = {"n": <first + i>}`.
fn rows_for(subject: &str, first: i64, n: i64) -> Vec<(Uuid, String, Value)> {
    (first..first + n)
        .map(|i| {
            (
                Uuid::now_v7(),
                subject.to_owned(),
                serde_json::json!({ "n": i }),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------
// The stream, read back in stream order.

/// One message of the stream: its NATS subject and its parsed CloudEvents body.
struct Received {
    nats_subject: String,
    event: Value,
}

impl Received {
    fn id(&self) -> &str {
        self.event["id"].as_str().unwrap_or_default()
    }

    fn subject(&self) -> &str {
        self.event["subject"].as_str().unwrap_or_default()
    }

    fn data_i64(&self, field: &str) -> i64 {
        self.event["data"][field].as_i64().unwrap_or_else(|| {
            panic!(
                "message {} has no integer data.{field}: {}",
                self.id(),
                self.event
            )
        })
    }
}

/// Every message of `stream`, in stream order, through an ordered consumer
/// that starts at the first message.
async fn read_stream(url: &str, stream: &str) -> Vec<Received> {
    let messages = super::support::stream_messages(url, stream).await;
    messages
        .iter()
        .enumerate()
        .map(|(i, message)| {
            let event: Value = serde_json::from_slice(&message.payload).unwrap_or_else(|e| {
                panic!(
                    "message {} is not JSON ({e}): {}",
                    i + 1,
                    String::from_utf8_lossy(&message.payload)
                )
            });
            Received {
                nats_subject: message.subject.to_string(),
                event,
            }
        })
        .collect()
}

/// Every message appears once: returns the ids, panicking on a duplicate.
fn ids_once(messages: &[Received]) -> HashSet<String> {
    let mut seen = HashSet::new();
    let duplicates: Vec<&str> = messages
        .iter()
        .map(Received::id)
        .filter(|id| !seen.insert(id.to_string()))
        .collect();
    assert!(
        duplicates.is_empty(),
        "{} messages are stored more than once, e.g. {:?}",
        duplicates.len(),
        &duplicates[..duplicates.len().min(5)]
    );
    seen
}

/// Every message has a `sequence` of exactly 20 decimal digits, strictly
/// increasing along the stream per envelope subject.
fn assert_sequences(messages: &[Received]) {
    let mut last: HashMap<&str, &str> = HashMap::new();
    let mut problems = Vec::new();
    for m in messages {
        let sequence = m.event.get("sequence").and_then(Value::as_str);
        let Some(sequence) =
            sequence.filter(|s| s.len() == 20 && s.bytes().all(|b| b.is_ascii_digit()))
        else {
            problems.push(format!(
                "{} ({}): sequence {:?} is not 20 decimal digits",
                m.id(),
                m.subject(),
                m.event.get("sequence")
            ));
            continue;
        };
        if let Some(previous) = last.insert(m.subject(), sequence)
            && previous >= sequence
        {
            problems.push(format!(
                "{}: sequence {sequence} follows {previous}",
                m.subject()
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} of {} messages break the sequence rule, e.g.:\n{}",
        problems.len(),
        messages.len(),
        problems[..problems.len().min(10)].join("\n")
    );
}

/// Per envelope subject, `data.<field>` strictly increases along the stream.
/// Returns the values per subject.
fn assert_increasing_per_subject(messages: &[Received], field: &str) -> BTreeMap<String, Vec<i64>> {
    let mut per_subject: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for m in messages {
        per_subject
            .entry(m.subject().to_owned())
            .or_default()
            .push(m.data_i64(field));
    }
    let out_of_order: Vec<String> = per_subject
        .iter()
        .filter(|(_, values)| values.windows(2).any(|w| w[0] >= w[1]))
        .map(|(subject, values)| format!("{subject}: {field} {values:?}"))
        .collect();
    assert!(
        out_of_order.is_empty(),
        "{} of {} subjects reached the stream out of change order, e.g.:\n{}",
        out_of_order.len(),
        per_subject.len(),
        out_of_order[..out_of_order.len().min(10)].join("\n")
    );
    per_subject
}

// ---------------------------------------------------------------------------
// 1. The writer that began first commits second.

const ENTITIES: usize = 50;

/// For each entity: A begins (and reads `now()`), then B begins, bumps the
/// entity's version, inserts its event and commits; A's bump waits for B's
/// row lock, gets the next version, and A commits its event last. A's row has
/// the earlier `created_at` (transaction start) but the later change.
async fn race_writers(db: &TestDb, entities: std::ops::Range<usize>) {
    const BUMP: &str = "update entities set version = version + 1 where id = $1 returning version";
    let ids: Vec<usize> = entities.collect();
    // Two connections per entity; 8 entities at a time stay within the pool.
    for wave in ids.chunks(8) {
        let races = wave.iter().map(|&k| {
            let pool = db.pool.clone();
            async move {
                let entity = format!("entity-{k}");
                let mut a = pool.begin().await.unwrap();
                sqlx::query("select now()").execute(&mut *a).await.unwrap();
                let mut b = pool.begin().await.unwrap();
                let v: i32 = sqlx::query_scalar(BUMP)
                    .bind(&entity)
                    .fetch_one(&mut *b)
                    .await
                    .unwrap();
                insert_version(&mut b, "writer-b", &entity, v).await;
                // A's bump blocks on B's row lock until B commits.
                let (a_version, committed) = tokio::join!(
                    sqlx::query_scalar::<_, i32>(BUMP)
                        .bind(&entity)
                        .fetch_one(&mut *a),
                    b.commit()
                );
                committed.unwrap();
                let a_version = a_version.unwrap();
                assert_eq!(a_version, v + 1);
                insert_version(&mut a, "writer-a", &entity, a_version).await;
                a.commit().await.unwrap();
            }
        });
        futures::future::join_all(races).await;
    }
}

/// `writer`'s event for `entity` at `version`, by plain SQL in `tx`.
async fn insert_version(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    writer: &str,
    entity: &str,
    version: i32,
) {
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         values ($1, 'entity.changed', $2, $3, now(), jsonb_build_object('version', $4::int))",
    )
    .bind(Uuid::now_v7())
    .bind(writer)
    .bind(entity)
    .bind(version)
    .execute(&mut **tx)
    .await
    .unwrap();
}

async fn entities_table(db: &TestDb) {
    sqlx::query("create table entities (id text primary key, version int not null)")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "insert into entities (id, version)
         select 'entity-' || k, 0 from generate_series(0, $1 - 1) k",
    )
    .bind(ENTITIES as i32)
    .execute(&db.pool)
    .await
    .unwrap();
}

/// The precondition that makes the race a trap for `created_at` ordering.
async fn assert_first_begun_commits_second(db: &TestDb) {
    assert_eq!(
        count_where(
            &db.pool,
            "source = 'writer-a' and created_at < (select created_at from outbox_events b
              where b.subject = outbox_events.subject and b.source = 'writer-b')"
        )
        .await,
        ENTITIES as i64,
        "every A row carries the earlier created_at"
    );
}

fn assert_change_order(messages: &[Received]) {
    assert_eq!(messages.len(), 2 * ENTITIES, "two events per entity");
    ids_once(messages);
    let versions = assert_increasing_per_subject(messages, "version");
    assert_eq!(versions.len(), ENTITIES);
    assert!(
        versions.values().all(|v| v == &[1, 2]),
        "every entity went through versions 1, 2"
    );
    assert_sequences(messages);
}

#[tokio::test(flavor = "multi_thread")]
async fn once_publishes_each_entity_in_change_order_when_the_first_begun_writer_commits_second() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    entities_table(&db).await;
    race_writers(&db, 0..ENTITIES).await;
    assert_first_begun_commits_second(&db).await;

    let relays = Relays::new(&db, broker.url(), "RACE_ONCE", "entity.>");
    let out = relays.once(&[]).await;
    assert!(
        out.status.success(),
        "outbox-relay --once failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(count_where(&db.pool, "published_at is null").await, 0);
    assert_change_order(&read_stream(broker.url(), &relays.stream).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn running_relays_publish_each_entity_in_change_order_when_the_first_begun_writer_commits_second()
 {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    entities_table(&db).await;
    // Half the races are a backlog when the relays start, half happen while
    // they run.
    race_writers(&db, 0..ENTITIES / 2).await;
    let relays = Relays::new(&db, broker.url(), "RACE_RUN", "entity.>");
    let mut replicas = relays.start("race", 2, &[]).await;
    race_writers(&db, ENTITIES / 2..ENTITIES).await;
    assert_first_begun_commits_second(&db).await;

    wait_until("all 100 published", Duration::from_secs(60), || async {
        count_where(&db.pool, "published_at is null").await == 0
    })
    .await
    .unwrap_or_else(|e| relays.fail(e, &mut replicas));
    for relay in &mut replicas {
        relays.assert_running(relay);
    }
    assert_change_order(&read_stream(broker.url(), &relays.stream).await);
}

// ---------------------------------------------------------------------------
// 2. Rows that can never be published.

/// One kind of unpublishable row: the word its `last_error` must contain, and
/// the column values that make it so (SQL expressions for `time` and `data`).
struct Poison {
    word: &'static str,
    event_type: &'static str,
    source: &'static str,
    subject: Option<&'static str>,
    time: &'static str,
    data: &'static str,
    traceparent: Option<&'static str>,
    tracestate: Option<&'static str>,
}

const VALID: Poison = Poison {
    word: "",
    event_type: "faults.changed",
    source: "sql-writer",
    subject: None,
    time: "now()",
    data: "'{\"n\": 0}'::jsonb",
    traceparent: None,
    tracestate: None,
};

fn poisons() -> Vec<Poison> {
    vec![
        Poison {
            word: "traceparent",
            traceparent: Some(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\r\nx-evil: 1",
            ),
            ..VALID
        },
        Poison {
            word: "traceparent",
            traceparent: Some("not a traceparent"),
            ..VALID
        },
        Poison {
            word: "tracestate",
            traceparent: Some(TRACEPARENT),
            tracestate: Some("vendor=a\r\nx-evil: 1"),
            ..VALID
        },
        Poison {
            word: "tracestate",
            traceparent: Some(TRACEPARENT),
            tracestate: Some("vendor=caf\u{e9}"),
            ..VALID
        },
        Poison {
            word: "time",
            time: "'infinity'",
            ..VALID
        },
        Poison {
            word: "time",
            time: "'-infinity'",
            ..VALID
        },
        Poison {
            word: "time",
            time: "'20000-01-01T00:00:00Z'",
            ..VALID
        },
        Poison {
            word: "data",
            data: "'{\"n\":1e400}'::jsonb",
            ..VALID
        },
        Poison {
            word: "type",
            event_type: "$JS.API.STREAM.DELETE.X",
            ..VALID
        },
        Poison {
            word: "type",
            event_type: "_INBOX.x",
            ..VALID
        },
        Poison {
            word: "type",
            event_type: "has space",
            ..VALID
        },
        Poison {
            word: "type",
            event_type: "a.*",
            ..VALID
        },
        Poison {
            word: "subject",
            subject: Some(""),
            ..VALID
        },
        Poison {
            word: "source",
            source: "",
            ..VALID
        },
        Poison {
            word: "payload",
            // Over nats-server's default max_payload of 1 MB.
            data: "jsonb_build_object('blob', repeat('x', 1200000))",
            ..VALID
        },
    ]
}

/// Inserts `poison` with `subject` (unless the poison sets its own).
async fn insert_poison(pool: &PgPool, poison: &Poison, subject: &str) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "insert into outbox_events (id, event_type, source, subject, time, data, traceparent, tracestate)
         values ($1, $2, $3, $4, {}, {}, $5, $6)",
        poison.time, poison.data
    )))
    .bind(id)
    .bind(poison.event_type)
    .bind(poison.source)
    .bind(poison.subject.unwrap_or(subject))
    .bind(poison.traceparent)
    .bind(poison.tracestate)
    .execute(pool)
    .await
    .unwrap_or_else(|e| panic!("inserting the {} poison: {e}", poison.word));
    id
}

/// The poisoned rows as the table shows them, for failure messages.
async fn poison_report(pool: &PgPool, poisons: &[Poison], ids: &[Uuid]) -> String {
    let rows: Vec<(Uuid, i32, Option<String>, bool)> = sqlx::query_as(
        "select id, attempts, left(last_error, 160), published_at is not null
           from outbox_events where id = any($1)",
    )
    .bind(ids)
    .fetch_all(pool)
    .await
    .unwrap();
    let rows: HashMap<Uuid, (i32, Option<String>, bool)> = rows
        .into_iter()
        .map(|(id, a, e, p)| (id, (a, e, p)))
        .collect();
    poisons
        .iter()
        .zip(ids)
        .map(|(poison, id)| {
            let (attempts, error, published) = &rows[id];
            format!(
                "  {:<11} attempts={attempts} published={published} last_error={error:?}",
                poison.word
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread")]
async fn unpublishable_rows_are_parked_naming_the_fault_and_block_only_their_subject() {
    parks_unpublishable_rows(&[]).await;
}

/// The same rows, read from the WAL: the same validation parks the same
/// faults, through the retry lane both sources share.
#[tokio::test(flavor = "multi_thread")]
async fn unpublishable_rows_read_from_the_wal_are_parked_the_same_way() {
    parks_unpublishable_rows(&["--source", "wal"]).await;
}

/// Every kind of unpublishable row, written by plain SQL between healthy
/// ones, against two relays started with `source` beside the test's flags.
async fn parks_unpublishable_rows(source: &[&str]) {
    const HEALTHY_ENTITIES: i64 = 20;
    const PER_ENTITY: i64 = 10;
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let poisons = poisons();

    // Half the healthy rows before the poison, half after, so the bad rows
    // sit in the middle of every claim order.
    let healthy_half = |half: i64| -> Vec<_> {
        (0..HEALTHY_ENTITIES)
            .flat_map(|e| rows_for(&format!("ent-{e}"), half * PER_ENTITY / 2, PER_ENTITY / 2))
            .collect()
    };
    let first = healthy_half(0);
    insert_events(&db.pool, "faults.changed", &first).await;
    let mut bad = Vec::new();
    let mut followers = Vec::new();
    for (i, poison) in poisons.iter().enumerate() {
        let subject = format!("poisoned-{i}");
        bad.push(insert_poison(&db.pool, poison, &subject).await);
        // Valid rows of the same subject, inserted after their bad head.
        let behind = rows_for(poison.subject.unwrap_or(&subject), 0, 2);
        insert_events(&db.pool, "faults.changed", &behind).await;
        followers.extend(behind.iter().map(|r| r.0));
    }
    let second = healthy_half(1);
    insert_events(&db.pool, "faults.changed", &second).await;
    let healthy: Vec<Uuid> = first.iter().chain(&second).map(|r| r.0).collect();
    let healthy_total = healthy.len() as i64;

    let relays = Relays::new(&db, broker.url(), "POISON", "faults.>");
    let mut flags = vec![
        "--max-attempts",
        "3",
        "--backoff-base",
        "50ms",
        "--max-backoff",
        "200ms",
    ];
    flags.extend_from_slice(source);
    let mut replicas = relays.start("poison", 2, &flags).await;

    let settled = wait_until(
        "every bad row parked and every healthy row published",
        Duration::from_secs(60),
        || async {
            let parked: i64 = sqlx::query_scalar(
                "select count(*) from outbox_events where id = any($1)
                   and published_at is null and attempts >= 3 and last_error is not null",
            )
            .bind(&bad)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            let published: i64 = sqlx::query_scalar(
                "select count(*) from outbox_events where id = any($1) and published_at is not null",
            )
            .bind(&healthy)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            parked == bad.len() as i64 && published == healthy_total
        },
    )
    .await;
    if let Err(e) = settled {
        let published: i64 = sqlx::query_scalar(
            "select count(*) from outbox_events where id = any($1) and published_at is not null",
        )
        .bind(&healthy)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        let state = format!(
            "{e}\nhealthy published: {published}/{healthy_total}\nbad rows:\n{}",
            poison_report(&db.pool, &poisons, &bad).await
        );
        relays.fail(state, &mut replicas);
    }

    // Each parked row names its fault.
    let errors: Vec<(Uuid, Option<String>)> =
        sqlx::query_as("select id, last_error from outbox_events where id = any($1)")
            .bind(&bad)
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let errors: HashMap<Uuid, String> = errors
        .into_iter()
        .map(|(id, e)| (id, e.unwrap_or_default().to_lowercase()))
        .collect();
    let unnamed: Vec<String> = poisons
        .iter()
        .zip(&bad)
        .filter(|(poison, id)| !errors[*id].contains(poison.word))
        .map(|(poison, id)| format!("  expected {:?} in {:?}", poison.word, errors[id]))
        .collect();
    assert!(
        unnamed.is_empty(),
        "last_error does not name the fault:\n{}",
        unnamed.join("\n")
    );

    // The rows behind a bad head wait; everything else is on the stream once.
    let overtaken: i64 = sqlx::query_scalar(
        "select count(*) from outbox_events where id = any($1) and published_at is not null",
    )
    .bind(&followers)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(overtaken, 0, "rows overtook their parked head");
    let messages = read_stream(broker.url(), &relays.stream).await;
    let ids = ids_once(&messages);
    let expected: HashSet<String> = healthy.iter().map(Uuid::to_string).collect();
    assert_eq!(ids, expected, "the stream holds exactly the healthy rows");
    assert!(messages.iter().all(|m| m.nats_subject == "faults.changed"));
    assert_increasing_per_subject(&messages, "n");
    assert_sequences(&messages);

    // Both replicas live through it, and a restarted one stays up and works.
    for relay in &mut replicas {
        relays.assert_running(relay);
    }
    replicas[0].terminate().await;
    replicas[0].start().await.unwrap();
    let late = rows_for("late", 0, 10);
    insert_events(&db.pool, "faults.changed", &late).await;
    wait_until(
        "rows written after the restart published",
        Duration::from_secs(30),
        || async { count_where(&db.pool, "subject = 'late' and published_at is null").await == 0 },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, &mut replicas));
    // Long enough for the restarted relay to claim past the parked rows.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for relay in &mut replicas {
        relays.assert_running(relay);
    }
    assert_eq!(
        count_where(&db.pool, "published_at is not null").await,
        healthy_total + 10
    );
    if !source.is_empty() {
        for relay in &mut replicas {
            relay.terminate().await;
        }
        super::support::wal::drop_slots(&db.pool).await;
    }
}

// ---------------------------------------------------------------------------
// 3 and 4. The broker down.

#[tokio::test(flavor = "multi_thread")]
async fn a_relay_started_before_the_broker_waits_without_burning_attempts_then_delivers() {
    let db = TestDb::new().await.unwrap();
    // Learn a port nats-server will use, then take the server away.
    let mut broker = blocking(NatsServer::start).unwrap();
    let url = broker.url();
    blocking(|| broker.kill()).unwrap();

    let rows: Vec<_> = (0..10)
        .flat_map(|s| rows_for(&format!("acct-{s}"), 0, 10))
        .collect();
    insert_events(&db.pool, "early.charged", &rows).await;

    let relays = Relays::new(&db, &url, "EARLY", "early.>");
    let mut relay = relays.start("early", 1, &[]).await.remove(0);
    tokio::time::sleep(Duration::from_secs(2)).await;
    relays.assert_running(&mut relay);
    assert_eq!(
        count_where(&db.pool, "attempts > 0").await,
        0,
        "no attempt burned while no broker listens"
    );
    assert_eq!(count_where(&db.pool, "published_at is not null").await, 0);

    blocking(|| broker.start_again()).unwrap();
    let delivered = wait_until(
        "all 100 in the stream and marked published",
        Duration::from_secs(60),
        || async {
            count_where(&db.pool, "published_at is null").await == 0
                && stream_count(&url, &relays.stream).await == 100
        },
    )
    .await;
    if let Err(e) = delivered {
        relays.fail(e, std::slice::from_mut(&mut relay));
    }
    relays.assert_running(&mut relay);
    assert_eq!(count_where(&db.pool, "attempts > 0").await, 0);
    let messages = read_stream(&url, &relays.stream).await;
    let expected: HashSet<String> = rows.iter().map(|r| r.0.to_string()).collect();
    assert_eq!(ids_once(&messages), expected);
    assert_increasing_per_subject(&messages, "n");
    assert_sequences(&messages);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_outage_longer_than_the_backoff_budget_burns_no_attempts() {
    let db = TestDb::new().await.unwrap();
    let mut broker = blocking(NatsServer::start).unwrap();
    let url = broker.url();
    let relays = Relays::new(&db, &url, "OUTAGE", "outage.>");
    let mut relay = relays
        .start(
            "outage",
            1,
            &[
                "--max-attempts",
                "3",
                "--backoff-base",
                "20ms",
                "--max-backoff",
                "100ms",
                "--publish-timeout",
                "500ms",
            ],
        )
        .await
        .remove(0);

    // The relay is up and publishing before the broker goes.
    let warm_up = rows_for("warm-up", 0, 5);
    insert_events(&db.pool, "outage.charged", &warm_up).await;
    wait_until("the warm-up published", Duration::from_secs(30), || async {
        count_where(&db.pool, "published_at is null").await == 0
    })
    .await
    .unwrap_or_else(|e| relays.fail(e, std::slice::from_mut(&mut relay)));

    blocking(|| broker.kill()).unwrap();
    let rows: Vec<_> = (0..5)
        .flat_map(|s| rows_for(&format!("acct-{s}"), 0, 10))
        .collect();
    insert_events(&db.pool, "outage.charged", &rows).await;
    // 3 attempts at 20–100 ms of backoff would be spent many times over.
    tokio::time::sleep(Duration::from_secs(4)).await;
    relays.assert_running(&mut relay);
    let burned: Vec<(String, i32, Option<String>)> = sqlx::query_as(
        "select subject, attempts, last_error from outbox_events where attempts > 0 order by subject",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(
        burned.is_empty(),
        "{} rows burned attempts while the broker was down, e.g. {:?}",
        burned.len(),
        burned.first()
    );
    assert_eq!(
        count_where(&db.pool, "attempts >= 3").await,
        0,
        "none parked"
    );
    assert_eq!(count_where(&db.pool, "published_at is null").await, 50);

    blocking(|| broker.start_again()).unwrap();
    wait_until(
        "all 50 delivered after the broker is back",
        Duration::from_secs(60),
        || async {
            count_where(&db.pool, "published_at is null").await == 0
                && stream_count(&url, &relays.stream).await == 55
        },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, std::slice::from_mut(&mut relay)));
    relays.assert_running(&mut relay);
    assert_eq!(count_where(&db.pool, "attempts > 0").await, 0);
    let messages = read_stream(&url, &relays.stream).await;
    let ids = ids_once(&messages);
    assert!(rows.iter().all(|r| ids.contains(&r.0.to_string())));
    assert_increasing_per_subject(&messages, "n");
    assert_sequences(&messages);
}

// ---------------------------------------------------------------------------
// 5. A large backlog, four replicas, one killed mid-drain.

#[tokio::test(flavor = "multi_thread")]
async fn four_replicas_drain_a_large_backlog_once_and_in_order_through_a_kill_9() {
    const EVENTS: i32 = 50_000;
    const SUBJECTS: i32 = 1_000;
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();

    // One statement; per entity `n` grows in insert order.
    let ids: Vec<Uuid> = (0..EVENTS).map(|_| Uuid::now_v7()).collect();
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         select ($1::uuid[])[g + 1], 'drain.changed', 'bulk-writer', 'e-' || (g % $2), now(),
                jsonb_build_object('n', g / $2)
           from generate_series(0, $3 - 1) g
          order by g",
    )
    .bind(&ids)
    .bind(SUBJECTS)
    .bind(EVENTS)
    .execute(&db.pool)
    .await
    .unwrap();

    let relays = Relays::new(&db, broker.url(), "DRAIN", "drain.>");
    // Two on the default single thread, two on a multi-threaded runtime.
    let mut replicas = relays.start("drain", 2, &[]).await;
    replicas.extend(relays.start("drain-mt", 2, &["--threads", "2"]).await);
    wait_until(
        "a fifth of the backlog published",
        Duration::from_secs(120),
        || async {
            count_where(&db.pool, "published_at is not null").await >= i64::from(EVENTS / 5)
        },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, &mut replicas));
    replicas[1].kill9().await;
    assert!(
        count_where(&db.pool, "published_at is null").await > 0,
        "killed before the end of the drain"
    );
    replicas[1].start().await.unwrap();

    let drained = wait_until(
        "all 50,000 published and in the stream",
        Duration::from_secs(180),
        || async {
            count_where(&db.pool, "published_at is null").await == 0
                && stream_count(broker.url(), &relays.stream).await >= EVENTS as u64
        },
    )
    .await;
    if let Err(e) = drained {
        let state = format!(
            "{e}: {} unpublished, {} in the stream",
            count_where(&db.pool, "published_at is null").await,
            stream_count(broker.url(), &relays.stream).await
        );
        relays.fail(state, &mut replicas);
    }
    for relay in &mut replicas {
        relays.assert_running(relay);
    }
    let messages = read_stream(broker.url(), &relays.stream).await;
    assert_eq!(messages.len(), EVENTS as usize, "each event stored once");
    let stored = ids_once(&messages);
    assert_eq!(stored.len(), EVENTS as usize);
    assert!(ids.iter().all(|id| stored.contains(&id.to_string())));
    let per_subject = assert_increasing_per_subject(&messages, "n");
    assert_eq!(per_subject.len(), SUBJECTS as usize);
    assert_sequences(&messages);
}

// ---------------------------------------------------------------------------
// 6. A relay frozen for longer than its lease.

/// Shards held, per relay session: (sessions holding shards, shards held).
async fn shard_holders(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "select count(distinct pid), count(*) from pg_locks
          where locktype = 'advisory' and classid::text::bigint = 1868722690 and granted",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_relay_frozen_longer_than_its_lease_loses_its_shards_and_nothing_is_lost_or_reordered() {
    const SUBJECTS: i32 = 200;
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let relays = Relays::new(&db, broker.url(), "FROZEN", "frozen.>");
    let extra = ["--lease", "3s", "--publish-timeout", "1s"];
    let mut replicas = relays.start("frozen", 2, &extra).await;
    wait_until(
        "both relays holding shards",
        Duration::from_secs(30),
        || async { shard_holders(&db.pool).await == (2, 64) },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, &mut replicas));

    let insert = |round: i32| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(
                "insert into outbox_events (id, event_type, source, subject, time, data)
                 select gen_random_uuid(), 'frozen.changed', 'writer', 'e-' || (g % $1), now(),
                        jsonb_build_object('n', $2 * 100 + g / $1)
                   from generate_series(0, 10 * $1 - 1) g
                  order by g",
            )
            .bind(SUBJECTS)
            .bind(round)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    // Frozen (SIGSTOP) with its shards: the server ends its idle lock session
    // after the lease, and the other relay takes the shards over.
    replicas[0].signal("STOP").await;
    insert(1).await;
    wait_until(
        "every row published by the relay left running",
        Duration::from_secs(60),
        || async { count_where(&db.pool, "published_at is null").await == 0 },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, &mut replicas));
    wait_until(
        "the relay left running holding every shard",
        Duration::from_secs(15),
        || async { shard_holders(&db.pool).await == (1, 64) },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, &mut replicas));

    // Thawed: it finds its session gone, rejoins, and takes its share back.
    replicas[0].signal("CONT").await;
    wait_until(
        "the thawed relay holding shards again",
        Duration::from_secs(30),
        || async { shard_holders(&db.pool).await == (2, 64) },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, &mut replicas));
    insert(2).await;
    wait_until(
        "the second round published",
        Duration::from_secs(60),
        || async { count_where(&db.pool, "published_at is null").await == 0 },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, &mut replicas));
    for relay in &mut replicas {
        relays.assert_running(relay);
    }
    let total = 2 * 10 * SUBJECTS as usize;
    wait_until(
        "the stream holds every event",
        Duration::from_secs(10),
        || async { stream_count(broker.url(), &relays.stream).await >= total as u64 },
    )
    .await
    .unwrap();
    let messages = read_stream(broker.url(), &relays.stream).await;
    assert_eq!(messages.len(), total, "each event stored once");
    assert_eq!(ids_once(&messages).len(), total);
    assert_increasing_per_subject(&messages, "n");
    assert_sequences(&messages);
}

// ---------------------------------------------------------------------------
// 7. The seq sequence going back under a running relay.

/// PostgreSQL hands out again, after a crash, sequence values that only
/// uncommitted transactions had taken (their WAL reservation was not flushed);
/// `setval` does the same on purpose. Rows written with those seqs land below
/// the shards' cursors: the relay must notice and read them at once, not at
/// its next 60 s sweep.
#[tokio::test(flavor = "multi_thread")]
async fn rows_written_after_the_seq_sequence_went_back_are_published_at_once() {
    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url(), "SEQBACK", "seqback.>");
    let mut relay = relays.start("seqback", 1, &[]).await.remove(0);

    // Every shard's cursor moves well past seq 1,000.
    let before: Vec<_> = (0..200)
        .flat_map(|s| rows_for(&format!("before-{s}"), 0, 10))
        .collect();
    insert_events(&db.pool, "seqback.charged", &before).await;
    wait_until("2,000 rows published", Duration::from_secs(60), || async {
        count_where(&db.pool, "published_at is null").await == 0
    })
    .await
    .unwrap_or_else(|e| relays.fail(e, std::slice::from_mut(&mut relay)));
    // Give the horizon a few ticks to settle past them (each batch ticks it).
    let warm: Vec<_> = (0..64)
        .map(|s| rows_for(&format!("warm-{s}"), 0, 1).remove(0))
        .collect();
    insert_events(&db.pool, "seqback.charged", &warm).await;
    wait_until(
        "the warm rows published",
        Duration::from_secs(30),
        || async { count_where(&db.pool, "published_at is null").await == 0 },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, std::slice::from_mut(&mut relay)));

    sqlx::query("select setval('outbox_events_seq', 10)")
        .execute(&db.pool)
        .await
        .unwrap();
    let after: Vec<_> = (0..64)
        .flat_map(|s| rows_for(&format!("after-{s}"), 0, 3))
        .collect();
    insert_events(&db.pool, "seqback.charged", &after).await;
    assert!(
        count(
            &db.pool,
            "select max(seq) from outbox_events where subject like 'after-%'"
        )
        .await
            < 1_000,
        "the new rows carry seqs below the cursors"
    );
    wait_until(
        "the rows written after the sequence went back published within 15 s",
        Duration::from_secs(15),
        || async { count_where(&db.pool, "published_at is null").await == 0 },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, std::slice::from_mut(&mut relay)));
    relays.assert_running(&mut relay);
    let messages = read_stream(nats.url(), &relays.stream).await;
    let ids = ids_once(&messages);
    assert!(after.iter().all(|r| ids.contains(&r.0.to_string())));
    assert_increasing_per_subject(&messages, "n");
}

// ---------------------------------------------------------------------------
// 8. One hot entity: its rows go out in atomic batches, and nothing that
// fails in the middle of one lets a later row be stored before an earlier.

/// Checks, for a stream written only by the relay (from sequence 1, nothing
/// deleted), that every row marked published names the stream and its
/// message's sequence there.
async fn assert_positions(pool: &PgPool, stream: &str, messages: &[Received]) {
    let marked: Vec<(Uuid, Option<String>, Option<i64>)> = sqlx::query_as(
        "select id, published_stream, published_seq from outbox_events where published_at is not null",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let at: HashMap<&str, i64> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| (m.id(), i64::try_from(i).unwrap() + 1))
        .collect();
    let wrong: Vec<String> = marked
        .iter()
        .filter(|(id, s, seq)| {
            s.as_deref() != Some(stream) || *seq != at.get(id.to_string().as_str()).copied()
        })
        .map(|(id, s, seq)| {
            format!(
                "{id}: marked {s:?} {seq:?}, stored at {:?}",
                at.get(id.to_string().as_str())
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} rows name another position than their message's, e.g.:\n{}",
        wrong.len(),
        marked.len(),
        wrong[..wrong.len().min(5)].join("\n")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hot_entity_is_stored_once_and_in_order_through_broker_kills_mid_pipeline() {
    let db = TestDb::new().await.unwrap();
    let mut broker = blocking(NatsServer::start).unwrap();
    let url = broker.url();
    let relays = Relays::new(&db, &url, "HOT", "hot.>");
    let mut relay = relays
        .start("hot", 1, &["--publish-timeout", "1s"])
        .await
        .remove(0);
    // The relay creates the stream, with atomic batches on this server.
    wait_until("the stream created", Duration::from_secs(30), || async {
        jetstream_client(&url)
            .await
            .get_stream(&relays.stream)
            .await
            .is_ok()
    })
    .await
    .unwrap_or_else(|e| relays.fail(e, std::slice::from_mut(&mut relay)));
    let config = jetstream_client(&url)
        .await
        .get_stream(&relays.stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    assert!(config.allow_atomic_publish, "created with allow_atomic");

    const ROWS: i64 = 5_000;
    let rows = rows_for("acct-hot", 0, ROWS);
    insert_events(&db.pool, "hot.charged", &rows).await;
    // Killed (SIGKILL) and started again three times while the backlog
    // drains: each kill lands after rows were published and before all were.
    let mut killed_at = Vec::new();
    for _ in 0..3 {
        let before = count_where(&db.pool, "published_at is not null").await;
        wait_until("more rows published", Duration::from_secs(60), || async {
            count_where(&db.pool, "published_at is not null").await > before
        })
        .await
        .unwrap_or_else(|e| relays.fail(e, std::slice::from_mut(&mut relay)));
        blocking(|| broker.kill()).unwrap();
        killed_at.push(count_where(&db.pool, "published_at is not null").await);
        tokio::time::sleep(Duration::from_millis(300)).await;
        blocking(|| broker.start_again()).unwrap();
    }
    assert!(
        killed_at[0] < ROWS,
        "the broker was killed in the middle of the backlog (published at the kills: {killed_at:?})"
    );
    wait_until(
        "all 5,000 published after the kills",
        Duration::from_secs(120),
        || async {
            count_where(&db.pool, "published_at is null").await == 0
                && stream_count(&url, &relays.stream).await >= 5_000
        },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, std::slice::from_mut(&mut relay)));
    relays.assert_running(&mut relay);
    assert_eq!(
        count_where(&db.pool, "attempts > 0").await,
        0,
        "broker faults cost no attempts"
    );
    let messages = read_stream(&url, &relays.stream).await;
    let ids = ids_once(&messages);
    assert_eq!(messages.len(), rows.len(), "every row once");
    assert!(rows.iter().all(|r| ids.contains(&r.0.to_string())));
    let n = assert_increasing_per_subject(&messages, "n");
    assert_eq!(n["acct-hot"], (0..ROWS).collect::<Vec<_>>(), "in seq order");
    assert_sequences(&messages);
    assert_positions(&db.pool, &relays.stream, &messages).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_full_in_the_middle_of_a_hot_entity_stores_no_later_row() {
    use async_nats::jetstream::stream::{Config, DiscardPolicy};

    let db = TestDb::new().await.unwrap();
    let nats = nats().unwrap();
    let relays = Relays::new(&db, nats.url(), "FULL", "full.>");
    // Room for about a hundred of the rows below: the stream refuses the
    // rest (discard new) until its limit is raised.
    let js = jetstream_client(nats.url()).await;
    let mut config = Config {
        name: relays.stream.clone(),
        subjects: vec!["full.>".into()],
        max_bytes: 60_000,
        discard: DiscardPolicy::New,
        duplicate_window: Duration::from_secs(120),
        allow_atomic_publish: true,
        ..Default::default()
    };
    js.create_stream(config.clone()).await.unwrap();
    let mut relay = relays
        .start(
            "full",
            1,
            &[
                "--max-attempts",
                "1000",
                "--backoff-base",
                "20ms",
                "--max-backoff",
                "200ms",
            ],
        )
        .await
        .remove(0);

    // Every fifth row is large: when one of them does not fit, the smaller
    // rows after it still would, and must not be stored before it.
    const ROWS: i64 = 1_000;
    let rows: Vec<(Uuid, String, Value)> = (0..ROWS)
        .map(|i| {
            let pad = "x".repeat(if i % 5 == 4 { 2_000 } else { 50 });
            (
                Uuid::now_v7(),
                "acct-full".to_owned(),
                serde_json::json!({ "n": i, "pad": pad }),
            )
        })
        .collect();
    insert_events(&db.pool, "full.charged", &rows).await;
    // The stream fills up; the first row that does not fit is refused
    // (nats-server answers 503 for a full stream: the relay waits for room,
    // as for a broker fault, without counting attempts) again and again.
    let mut last = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = stream_count(nats.url(), &relays.stream).await;
        if now > 0 && now == last {
            break;
        }
        if std::time::Instant::now() > deadline {
            relays.fail(
                format!("the stream did not fill up and stay ({now} messages)"),
                std::slice::from_mut(&mut relay),
            );
        }
        last = now;
    }
    let stored = stream_count(nats.url(), &relays.stream).await;
    let messages = read_stream(nats.url(), &relays.stream).await;
    assert!(
        stored > 10 && stored < 500,
        "{stored} stored under the limit"
    );
    // Nothing after the refused row is stored, nothing before it is missing.
    let n = assert_increasing_per_subject(&messages, "n");
    let stored_i64 = i64::try_from(stored).unwrap();
    assert_eq!(
        n["acct-full"],
        (0..stored_i64).collect::<Vec<_>>(),
        "exactly the first rows are stored, in order"
    );
    assert_eq!(
        count_where(&db.pool, "published_at is not null").await,
        stored_i64,
        "exactly the stored rows are marked"
    );
    assert_positions(&db.pool, &relays.stream, &messages).await;
    assert_eq!(count_where(&db.pool, "attempts > 0").await, 0);

    // The limit raised: the rest follows, each once, in order.
    config.max_bytes = -1;
    js.update_stream(&config).await.unwrap();
    wait_until(
        "all 1,000 published after the limit is raised",
        Duration::from_secs(60),
        || async { count_where(&db.pool, "published_at is null").await == 0 },
    )
    .await
    .unwrap_or_else(|e| relays.fail(e, std::slice::from_mut(&mut relay)));
    relays.assert_running(&mut relay);
    let messages = read_stream(nats.url(), &relays.stream).await;
    let ids = ids_once(&messages);
    assert_eq!(messages.len(), rows.len());
    assert!(rows.iter().all(|r| ids.contains(&r.0.to_string())));
    let n = assert_increasing_per_subject(&messages, "n");
    assert_eq!(n["acct-full"], (0..ROWS).collect::<Vec<_>>());
    assert_sequences(&messages);
    assert_positions(&db.pool, &relays.stream, &messages).await;
}
