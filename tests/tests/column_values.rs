//! Any value the columns accept: `subject`, `event_type` and `source` of any
//! length, written by plain SQL as a client in any language may write them,
//! and the size a writer measures against the bytes the relay sends. The
//! shipped `outbox-relay` and `outboxctl` binaries run as child processes
//! against a real PostgreSQL and nats-server.
//!
//! - Rows whose `subject`, `event_type` or `source` is 3,000 or 100,000
//!   characters long (text that does not compress) among ordinary rows, two
//!   relays running: each such row is parked with an error naming the column
//!   and its length, rows of its subject behind it are deferred, every other
//!   row is published, and the relays log one short line per row parked.
//!   `outboxctl status`, `stuck`, `retry` (of ids, `--entity`) and `skip` work
//!   on them; the rows woken by a skip are parked in turn.
//! - `Outbox::enqueue` measures `data` as the relay sends it (PostgreSQL's
//!   `jsonb` text, longer than compact JSON): an event at the limit by that
//!   measure is published whole, one just over it is refused at the write.
//! - Every query that looks a subject up in the retry lane is planned on the
//!   subject-hash index.
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use outbox_pg::{Envelope, ErrorKind, Outbox};
use outbox_testkit::{Program, TestDb, nats, wait_until};
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

const MAX_ATTEMPTS: &str = "3";

// ---------------------------------------------------------------------------
// Processes.

/// Two `outbox-relay` processes on one database and stream.
struct Relays {
    log_dir: PathBuf,
    stream: String,
    replicas: Vec<Program>,
}

impl Relays {
    async fn start(db: &TestDb, nats_url: &str, name: &str, subjects: &str, n: usize) -> Self {
        let unique = &db.name()[db.name().len() - 12..];
        let stream = format!("{name}_{unique}");
        let log_dir = std::env::temp_dir()
            .join("outbox-column-values")
            .join(db.name());
        std::fs::create_dir_all(&log_dir).unwrap();
        let mut replicas = Vec::new();
        for i in 1..=n {
            let mut relay = Program::new(
                &format!("{name}-{i}"),
                support::bin_dir().join("outbox-relay"),
                &log_dir,
            )
            .env("DATABASE_URL", db.url())
            .env("NATS_URL", nats_url)
            .args(["--stream", &stream, "--subjects", subjects])
            .args(["--max-attempts", MAX_ATTEMPTS])
            .args(["--backoff-base", "50ms", "--max-backoff", "500ms"]);
            relay.start().await.unwrap();
            replicas.push(relay);
        }
        Self {
            log_dir,
            stream,
            replicas,
        }
    }

    /// Every line the relays wrote, each relay's in order.
    fn lines(&self) -> Vec<String> {
        self.replicas
            .iter()
            .flat_map(|r| {
                std::fs::read_to_string(self.log_dir.join(format!("{}.log", r.name)))
                    .unwrap_or_default()
                    .lines()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Panics with `error` and the end of each relay's log (lines cut short).
    fn fail(&self, error: impl std::fmt::Display) -> ! {
        let tails: Vec<String> = self
            .replicas
            .iter()
            .map(|r| {
                let text = std::fs::read_to_string(self.log_dir.join(format!("{}.log", r.name)))
                    .unwrap_or_default();
                let lines: Vec<String> = text
                    .lines()
                    .map(|l| l.chars().take(400).collect())
                    .collect();
                format!(
                    "--- {}:\n{}",
                    r.name,
                    lines[lines.len().saturating_sub(20)..].join("\n")
                )
            })
            .collect();
        panic!("{error}\n{}", tails.join("\n"));
    }

    fn assert_running(&mut self) {
        let mut dead = Vec::new();
        for relay in &mut self.replicas {
            if !relay.is_running() || relay.died() {
                dead.push(relay.name.clone());
            }
        }
        if !dead.is_empty() {
            self.fail(format!("relays exited: {dead:?}"));
        }
    }
}

impl Drop for Relays {
    /// Keeps the logs only when the test failed.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

struct Ctl {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Ctl {
    /// stdout as JSON, panicking with stderr unless the command succeeded.
    fn json(&self) -> Value {
        assert!(self.ok, "outboxctl failed: {}", cut(&self.stderr));
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("outboxctl printed no JSON ({e}): {}", cut(&self.stdout)))
    }
}

/// `outboxctl --json <args>` against `db`, bounded.
async fn ctl(db: &TestDb, args: &[&str]) -> Ctl {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    ctl_text(db, &all).await
}

/// `outboxctl <args>` against `db`, bounded.
async fn ctl_text(db: &TestDb, args: &[&str]) -> Ctl {
    let run = tokio::process::Command::new(support::bin_dir().join("outboxctl"))
        .env("DATABASE_URL", db.url())
        .env_remove("DATABASE_URL_FILE")
        .env_remove("OUTBOX_MAX_ATTEMPTS")
        .args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("outboxctl finished within 60 s")
        .unwrap();
    Ctl {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The first 300 characters of `s`, for failure messages.
fn cut(s: &str) -> String {
    s.chars().take(300).collect()
}

// ---------------------------------------------------------------------------
// Rows, by plain SQL.

/// `len` characters of hex from a chain of md5 sums seeded by `seed`: text
/// that neither TOAST nor an index compresses much.
async fn long_text(pool: &PgPool, seed: &str, len: usize) -> String {
    let text: String = sqlx::query_scalar(
        "select left(string_agg(md5($1 || i::text), '' order by i), $2)
           from generate_series(1, $2 / 32 + 1) as i",
    )
    .bind(seed)
    .bind(i32::try_from(len).unwrap())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(text.len(), len);
    text
}

async fn insert(pool: &PgPool, event_type: &str, source: &str, subject: &str, n: i64) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         values ($1, $2, $3, $4, now(), jsonb_build_object('n', $5::bigint))",
    )
    .bind(id)
    .bind(event_type)
    .bind(source)
    .bind(subject)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
    id
}

/// `n` ordinary rows over 30 subjects.
async fn ordinary(pool: &PgPool, first: i64, n: i64) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for i in first..first + n {
        ids.push(insert(pool, "long.changed", "svc", &format!("ent-{}", i % 30), i).await);
    }
    ids
}

async fn count(pool: &PgPool, ids: &[Uuid], condition: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "select count(*) from outbox_events where id = any($1) and {condition}"
    )))
    .bind(ids)
    .fetch_one(pool)
    .await
    .unwrap()
}

const PARKED: &str = "published_at is null and skipped_at is null and attempts >= 3 \
                      and next_attempt_at = 'infinity' and last_error is not null";
const DEFERRED: &str =
    "published_at is null and skipped_at is null and attempts = 0 and next_attempt_at is not null";

/// Message ids in `stream`.
async fn stream_ids(url: &str, stream: &str) -> Vec<Uuid> {
    let js = jetstream::new(async_nats::connect(url).await.unwrap());
    let mut stream = js.get_stream(stream).await.unwrap();
    let total = stream.info().await.unwrap().state.messages as usize;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut ids = Vec::new();
    while ids.len() < total {
        let m = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("reading the stream timed out")
            .unwrap()
            .unwrap();
        let v: Value = serde_json::from_slice(&m.payload).unwrap();
        ids.push(v["id"].as_str().unwrap().parse().unwrap());
    }
    ids
}

// ---------------------------------------------------------------------------
// 1. Values of any length.

/// One row made unpublishable by the length of one column.
struct Long {
    column: &'static str,
    len: usize,
    id: Uuid,
    subject: String,
}

#[tokio::test(flavor = "multi_thread")]
async fn long_values_are_parked_named_once_and_can_be_retried_and_skipped() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let pool = &db.pool;

    let mut healthy = ordinary(pool, 0, 150).await;
    let mut long = Vec::new();
    for len in [3_000, 100_000] {
        for column in ["subject", "event_type", "source"] {
            let text = long_text(pool, &format!("{column}-{len}"), len).await;
            let (event_type, source, subject) = match column {
                "subject" => ("long.changed".to_owned(), "svc".to_owned(), text),
                // A subject the stream captures, but far longer than one may be.
                "event_type" => (
                    format!("long.{}", &text[5..]),
                    "svc".to_owned(),
                    format!("e-{column}-{len}"),
                ),
                _ => ("long.changed".to_owned(), text, format!("e-{column}-{len}")),
            };
            let id = insert(pool, &event_type, &source, &subject, 0).await;
            long.push(Long {
                column,
                len,
                id,
                subject,
            });
        }
    }
    // Two valid-looking rows behind the longest subject: deferred behind its
    // parked head (the deferral writes them into the retry lane's index).
    let longest = long
        .iter()
        .find(|l| l.column == "subject" && l.len == 100_000)
        .unwrap()
        .subject
        .clone();
    let followers = vec![
        insert(pool, "long.changed", "svc", &longest, 1).await,
        insert(pool, "long.changed", "svc", &longest, 2).await,
    ];
    healthy.extend(ordinary(pool, 150, 150).await);
    let heads: Vec<Uuid> = long.iter().map(|l| l.id).collect();

    let mut relays = Relays::start(&db, broker.url(), "LONG", "long.>", 2).await;
    let settled = wait_until(
        "the long rows parked, their followers deferred, the rest published",
        Duration::from_secs(60),
        || async {
            count(pool, &heads, PARKED).await == heads.len() as i64
                && count(pool, &followers, DEFERRED).await == 2
                && count(pool, &healthy, "published_at is not null").await == 300
        },
    )
    .await;
    if let Err(e) = settled {
        relays.fail(format!(
            "{e}: parked {}/6, deferred {}/2, published {}/300",
            count(pool, &heads, PARKED).await,
            count(pool, &followers, DEFERRED).await,
            count(pool, &healthy, "published_at is not null").await
        ));
    }

    // Each is named: the column, its length, and the limit, in a short error.
    let errors: HashMap<Uuid, String> = sqlx::query_as::<_, (Uuid, String)>(
        "select id, last_error from outbox_events where id = any($1)",
    )
    .bind(&heads)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    for l in &long {
        let error = &errors[&l.id];
        let name = if l.column == "event_type" {
            "event type"
        } else {
            l.column
        };
        assert!(
            error.contains(name)
                && error.contains(&format!("{} bytes", l.len))
                && error.len() < 400,
            "{} of {}: {}",
            l.column,
            l.len,
            cut(error)
        );
    }

    // One short line per parked row, in the two relays' logs together.
    let parks_logged = |relays: &Relays, ids: &[Uuid]| -> HashMap<Uuid, usize> {
        let lines = relays.lines();
        ids.iter()
            .map(|id| {
                let id_text = id.to_string();
                (*id, lines.iter().filter(|l| l.contains(&id_text)).count())
            })
            .collect()
    };
    let check_logs = |relays: &Relays, expected: &HashMap<Uuid, usize>| {
        let lines = relays.lines();
        let longest_line = lines.iter().map(String::len).max().unwrap_or(0);
        let loud = lines
            .iter()
            .filter(|l| l.contains("ERROR") || l.contains("WARN"))
            .count();
        let found = parks_logged(relays, &expected.keys().copied().collect::<Vec<_>>());
        let parks: usize = expected.values().sum();
        if found != *expected || longest_line > 2_000 || loud > parks + 4 {
            relays.fail(format!(
                "lines per row {found:?}, expected {expected:?}; longest line {longest_line} \
                 bytes; {loud} error/warn lines for {parks} parked rows"
            ));
        }
    };
    let mut expected: HashMap<Uuid, usize> = heads.iter().map(|id| (*id, 1)).collect();
    expected.extend(followers.iter().map(|id| (*id, 0)));
    // A few batches more: a failing statement would log again by now.
    tokio::time::sleep(Duration::from_secs(1)).await;
    check_logs(&relays, &expected);

    // outboxctl reads them.
    let status = ctl(&db, &["status", "--max-attempts", MAX_ATTEMPTS])
        .await
        .json();
    assert!(
        status.to_string().contains(&longest),
        "status names the subject"
    );
    // For people, each value is cut short: no line of 100,000 characters.
    for command in ["status", "stuck"] {
        let out = ctl_text(&db, &[command, "--max-attempts", MAX_ATTEMPTS]).await;
        assert!(out.ok, "{command}: {}", cut(&out.stderr));
        let longest = out.stdout.lines().map(str::len).max().unwrap_or(0);
        assert!(longest < 600, "{command}: a line of {longest} bytes");
        assert!(
            out.stdout.contains("(100000 bytes)"),
            "{command}: {}",
            cut(&out.stdout)
        );
    }
    let stuck = ctl(&db, &["stuck", "--max-attempts", MAX_ATTEMPTS])
        .await
        .json();
    assert_eq!(stuck["total"], json!(6), "{}", cut(&stuck.to_string()));

    // retry of ids, and of an entity by its 100,000-character subject: each
    // row is tried again, and parked again with one more line.
    let by_id: Vec<Uuid> = long
        .iter()
        .filter(|l| l.column != "subject")
        .map(|l| l.id)
        .collect();
    let ids: Vec<String> = by_id.iter().map(Uuid::to_string).collect();
    let mut args = vec!["retry"];
    args.extend(ids.iter().map(String::as_str));
    let retried = ctl(&db, &args).await.json();
    assert!(
        retried.to_string().contains(&ids[0]),
        "{}",
        cut(&retried.to_string())
    );
    let entity = ctl(&db, &["retry", "--entity", &longest]).await.json();
    let head = long.iter().find(|l| l.subject == longest).unwrap().id;
    assert!(
        entity.to_string().contains(&head.to_string()),
        "{}",
        cut(&entity.to_string())
    );
    for id in by_id.iter().chain([&head]) {
        *expected.get_mut(id).unwrap() += 1;
    }
    let parked_again = wait_until(
        "the retried rows parked again",
        Duration::from_secs(30),
        || async {
            let logged = parks_logged(&relays, &heads);
            count(pool, &heads, PARKED).await == 6
                && count(pool, &followers, DEFERRED).await == 2
                && heads.iter().all(|id| logged[id] == expected[id])
        },
    )
    .await;
    if let Err(e) = parked_again {
        relays.fail(e);
    }

    // skip: every head is abandoned; the followers of the longest subject are
    // woken, tried and parked (they are invalid too), then skipped.
    for l in &long {
        let skipped = ctl(&db, &["skip", &l.id.to_string(), "--reason", "too long"])
            .await
            .json();
        assert_eq!(skipped["subject"], json!(l.subject));
        if l.subject == longest {
            // Woken: each follower still deferred then. One whose deferral
            // behind the parked head had just run out is due already (the
            // relay defers it again at its next claim), so not listed: the
            // loop below sees every follower tried in order either way.
            let woken: Vec<Uuid> = serde_json::from_value(skipped["woken"].clone()).unwrap();
            assert!(
                woken.iter().all(|id| followers.contains(id)),
                "woken {woken:?}, followers {followers:?}"
            );
        }
    }
    // The first follower is tried and parked, and blocks the second, until
    // it is skipped in turn.
    for (i, id) in followers.iter().enumerate() {
        *expected.get_mut(id).unwrap() += 1;
        let parked = wait_until(
            "the woken follower parked",
            Duration::from_secs(30),
            || async {
                count(pool, &followers[i..=i], PARKED).await == 1
                    && count(pool, &followers[i + 1..], DEFERRED).await
                        == (followers.len() - i - 1) as i64
            },
        )
        .await;
        if let Err(e) = parked {
            relays.fail(e);
        }
        let skipped = ctl(&db, &["skip", &id.to_string(), "--reason", "too long"])
            .await
            .json();
        let woken: Vec<Uuid> = serde_json::from_value(skipped["woken"].clone()).unwrap();
        assert_eq!(woken, followers[i + 1..].to_vec());
    }
    assert_eq!(count(pool, &heads, "skipped_at is not null").await, 6);
    assert_eq!(count(pool, &followers, "skipped_at is not null").await, 2);
    tokio::time::sleep(Duration::from_secs(1)).await;
    check_logs(&relays, &expected);

    // Everything else flowed, once; both relays live through it.
    let mut on_stream = stream_ids(broker.url(), &relays.stream).await;
    on_stream.sort();
    healthy.sort();
    assert_eq!(
        on_stream, healthy,
        "the stream holds exactly the ordinary rows"
    );
    relays.assert_running();
}

// ---------------------------------------------------------------------------
// 2. The size the writer measures is the size the relay sends.

/// `{"ones": [1, 1, …]}` with `n` ones: 2 bytes a one in compact JSON, 3 in
/// PostgreSQL's jsonb text (`1, `).
/// At a time of whole microseconds, as the table stores it, so the relay's
/// `time` is as long as the writer's.
fn ones(n: usize) -> Envelope<Value> {
    let time = chrono::DateTime::from_timestamp(1_767_225_600, 123_456_000).unwrap();
    Envelope::new("size.checked", "svc", "s-1", json!({ "ones": vec![1; n] }))
        .unwrap()
        .with_time(time)
}

/// The header block the writer counts: `Nats-Msg-Id`, and
/// `Nats-Expected-Stream` at its longest (a 255-byte stream name).
const HEADERS: usize = "NATS/1.0\r\n".len()
    + "Nats-Msg-Id: \r\n".len()
    + 36
    + "Nats-Expected-Stream: \r\n".len()
    + 255
    + "\r\n".len();

#[tokio::test(flavor = "multi_thread")]
async fn the_writer_measures_the_jsonb_text_the_relay_sends() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let limit = outbox_pg::DEFAULT_MAX_MESSAGE_SIZE;

    // The largest event within the limit by the jsonb measure (3 bytes a one).
    let base = ones(0).message_size().unwrap();
    let mut n = (limit - base) / 3 + 1;
    while ones(n).message_size().unwrap() > limit {
        n -= 1;
    }
    let fits = ones(n);
    let over = ones(n + 1);
    let compact = |e: &Envelope<Value>| serde_json::to_vec(e.data()).unwrap().len();
    assert!(over.message_size().unwrap() > limit);
    assert!(
        compact(&over) + base < limit * 3 / 4,
        "compact JSON would fit by far: the old measure accepted it"
    );

    let outbox = Outbox::unvalidated();
    let mut tx = db.pool.begin().await.unwrap();
    let err = outbox.enqueue(&mut tx, &over).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    outbox.enqueue(&mut tx, &fits).await.unwrap();
    tx.commit().await.unwrap();
    let stored: i32 = sqlx::query_scalar("select octet_length(data::text) from outbox_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        stored as usize,
        fits.message_size().unwrap() - base + r#"{"ones": []}"#.len()
    );

    let mut relays = Relays::start(&db, broker.url(), "SIZE", "size.>", 1).await;
    let published = wait_until(
        "the event at the limit published",
        Duration::from_secs(30),
        || async {
            sqlx::query_scalar::<_, bool>(
                "select bool_and(published_at is not null) from outbox_events",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap()
        },
    )
    .await;
    if let Err(e) = published {
        let error: Option<String> = sqlx::query_scalar("select last_error from outbox_events")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        relays.fail(format!("{e}: last_error {error:?}"));
    }
    let js = jetstream::new(async_nats::connect(broker.url()).await.unwrap());
    let message = js
        .get_stream(&relays.stream)
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap();
    let sent: Value = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(sent["data"], *fits.data(), "data verbatim");
    // The bytes sent are the bytes measured (with a sequence, as the relay
    // adds), apart from the header block the writer counts at its longest.
    assert_eq!(
        message.payload.len() + HEADERS,
        fits.message_size().unwrap()
    );
    relays.assert_running();
}

// ---------------------------------------------------------------------------
// 3. Subject lookups in the retry lane stay on its index.

/// Every query that looks a subject up in the retry lane, as the server plans
/// it for any parameters (the generic plan, which a prepared statement may
/// switch to), on 200,000 rows with 20,000 in the retry lane: each reads
/// `outbox_events_retry_subject_idx` by the subject's hash.
#[tokio::test]
async fn subject_lookups_stay_on_the_hashed_index() {
    let db = TestDb::new().await.unwrap();
    sqlx::raw_sql(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         select gen_random_uuid(), 'long.changed', 'svc', 'ent-' || (g % 5000), now(), '{}'
           from generate_series(1, 200000) as g;
         update outbox_events set next_attempt_at = now() + interval '1 hour', attempts = 1
          where seq % 10 = 0;
         analyze outbox_events;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let cases = [
        (
            "outbox-publisher/queries/claim.sql",
            "smallint[], bigint[], int[], int, bigint, bigint, int, bigint",
            "'{1,2,3,4}', '{0,0,0,0}', '{50,50,50,50}', 20, 1000000, 1048576, 50, 9223372036854775807",
        ),
        (
            "outbox-publisher/queries/wal_blockers.sql",
            "text[], bigint[], int",
            "'{ent-1,ent-2}', '{100,100}', 20",
        ),
        (
            "outbox-publisher/queries/wake_followers.sql",
            "text[]",
            "'{ent-1,ent-2}'",
        ),
        ("outboxctl/queries/retry_entity.sql", "text", "'ent-7'"),
        (
            "outboxctl/queries/skip_wake.sql",
            "text, bigint",
            "'ent-7', 100",
        ),
        (
            "outboxctl/queries/stuck_list.sql",
            "int, text, text, bigint",
            "20, null, null, 50",
        ),
        (
            "outboxctl/queries/status_blocked.sql",
            "int, bigint",
            "20, 50",
        ),
    ];
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::raw_sql("set plan_cache_mode = force_generic_plan")
        .execute(&mut *conn)
        .await
        .unwrap();
    for (i, (file, types, args)) in cases.iter().enumerate() {
        let sql = std::fs::read_to_string(root.join(file)).unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "prepare q{i}({types}) as {sql}"
        )))
        .execute(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("{file}: {e}"));
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "explain (costs off) execute q{i}({args})"
        )))
        .fetch_all(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("{file}: {e}"));
        let plan = plan.join("\n");
        assert!(
            plan.contains("outbox_events_retry_subject_idx")
                && plan.contains("hashtextextended(subject"),
            "{file} does not read the retry lane by the subject's hash:\n{plan}"
        );
    }
}
