//! `outboxctl`'s outbox commands (status, stuck, retry, skip, prune), run as
//! an operator runs them: the shipped binary as a child process against a
//! real PostgreSQL, with the real `outbox-relay` publishing to a real
//! nats-server where the promise involves the relay; every `--json` output
//! parsed and asserted on.
//!
//! - A head row the relay parked blocks its subject: `status` counts it, names
//!   the subject with its waiting rows and the relay session with its shards;
//!   `stuck` lists it with its error. `skip` records who, when and why, and the
//!   running relay publishes the rows behind it at once; the skipped row stays
//!   unpublished, is not backlog, and `prune` never deletes it.
//! - `retry` (of ids, `--entity`, `--all-stuck`) after the cause is fixed: the
//!   running relay publishes the rows, in order.
//! - `prune --dry-run` counts and deletes nothing; `prune` deletes exactly the
//!   published rows older than the window.
//! - Errors: a closed port, a database without the tables, an unknown id —
//!   exit status 1, one line on stderr, no backtrace, a parseable `--json`
//!   error, and nothing changed.
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

use super::support::count_where;

use std::path::PathBuf;
use std::time::Duration;

use outbox_testkit::{Program, TestDb, nats, wait_until};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

/// A traceparent no relay can send: the row is parked at its first attempt.
const BAD_TRACEPARENT: &str = "not a traceparent";
pub(super) const MAX_ATTEMPTS: &str = "3";
const EVENT_TYPE: &str = "ctl.changed";

// ---------------------------------------------------------------------------
// outboxctl, run to completion.

pub(super) struct Ctl {
    pub(super) status: std::process::ExitStatus,
    pub(super) stdout: String,
    pub(super) stderr: String,
}

impl Ctl {
    /// stdout as JSON, panicking with both streams if it is not.
    pub(super) fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "outboxctl printed no JSON ({e}):\nstdout: {}\nstderr: {}",
                self.stdout, self.stderr
            )
        })
    }

    /// The JSON of a successful run.
    pub(super) fn ok(&self) -> Value {
        assert!(
            self.status.success(),
            "outboxctl failed ({}):\nstdout: {}\nstderr: {}",
            self.status,
            self.stdout,
            self.stderr
        );
        self.json()
    }

    /// The `{"error": {"kind", "message"}}` of a failed run, after checking
    /// exit status 1 and one line on stderr without a backtrace.
    pub(super) fn error(&self) -> (String, String) {
        assert_eq!(
            self.status.code(),
            Some(1),
            "expected exit status 1:\nstdout: {}\nstderr: {}",
            self.stdout,
            self.stderr
        );
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "stderr is not one line: {:?}", self.stderr);
        assert!(
            lines[0].starts_with("outboxctl: "),
            "stderr: {:?}",
            self.stderr
        );
        for word in ["panicked", "backtrace", "RUST_BACKTRACE"] {
            assert!(!self.stderr.contains(word), "stderr: {:?}", self.stderr);
        }
        let v = self.json();
        let kind = v["error"]["kind"].as_str().unwrap().to_owned();
        let message = v["error"]["message"].as_str().unwrap().to_owned();
        assert!(
            lines[0].contains(&message),
            "stderr {:?} and the JSON message {message:?} differ",
            lines[0]
        );
        (kind, message)
    }
}

fn ctl_path() -> PathBuf {
    let path = super::support::bin_dir().join("outboxctl");
    assert!(
        path.is_file(),
        "{} is missing: build the binaries first with `cargo build --workspace --bins`",
        path.display()
    );
    path
}

/// `outboxctl <args>` against `url` (as DATABASE_URL), bounded.
pub(super) async fn ctl(url: &str, args: &[&str]) -> Ctl {
    ctl_with(url, args, &[]).await
}

/// [`ctl`] with extra environment variables.
pub(super) async fn ctl_with(url: &str, args: &[&str], env: &[(&str, &str)]) -> Ctl {
    let run = tokio::process::Command::new(ctl_path())
        .envs(env.iter().copied())
        .env("DATABASE_URL", url)
        .env_remove("DATABASE_URL_FILE")
        .env_remove("OUTBOX_MAX_ATTEMPTS")
        .env_remove("OUTBOX_RETENTION")
        .env("RUST_BACKTRACE", "1")
        .args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("outboxctl finished within 60 s")
        .unwrap();
    Ctl {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `outboxctl --json status --max-attempts 3`.
pub(super) async fn status(db: &TestDb) -> Value {
    ctl(
        db.url(),
        &["--json", "status", "--max-attempts", MAX_ATTEMPTS],
    )
    .await
    .ok()
}

pub(super) fn i(v: &Value) -> i64 {
    v.as_i64()
        .unwrap_or_else(|| panic!("{v} is not an integer"))
}

pub(super) fn ids(v: &Value) -> Vec<Uuid> {
    v.as_array()
        .unwrap_or_else(|| panic!("{v} is not an array"))
        .iter()
        .map(|id| id.as_str().unwrap().parse().unwrap())
        .collect()
}

// ---------------------------------------------------------------------------
// The relay, and the stream it fills.

pub(super) struct Relay {
    program: Program,
    log_dir: PathBuf,
    pub(super) stream: String,
}

impl Relay {
    /// One `outbox-relay` on `db` publishing `ctl.>` to a stream of its own:
    /// attempt cap 3, parked-row deferral (the backoff cap) 10 s, so rows
    /// behind a parked head that get published well within 10 s were woken,
    /// not timed out; no retention (the tests prune).
    pub(super) async fn start(db: &TestDb, nats_url: &str, name: &str) -> Self {
        let unique = &db.name()[db.name().len() - 12..];
        let stream = format!("{name}_{unique}");
        let log_dir = std::env::temp_dir().join("outboxctl-tests").join(db.name());
        std::fs::create_dir_all(&log_dir).unwrap();
        let mut program = Program::new(
            name,
            super::support::bin_dir().join("outbox-relay"),
            &log_dir,
        )
        .env("DATABASE_URL", db.url())
        .env("NATS_URL", nats_url)
        .args(["--stream", &stream, "--subjects", "ctl.>"])
        .args(["--max-attempts", MAX_ATTEMPTS])
        .args(["--backoff-base", "50ms", "--max-backoff", "10s"])
        .args(["--retention", "0s"]);
        program.start().await.unwrap();
        Self {
            program,
            log_dir,
            stream,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_dir.join(format!("{}.log", self.program.name)))
            .unwrap_or_default()
    }

    /// Panics with `error` and the relay's log.
    pub(super) fn fail(&self, error: impl std::fmt::Display) -> ! {
        panic!("{error}\n--- relay log:\n{}", self.log());
    }

    pub(super) async fn stop(&mut self) {
        assert_eq!(self.program.terminate().await, Some(0), "{}", self.log());
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

/// Every message of `stream` in stream order: (id, subject, data.n).
pub(super) async fn read_stream(url: &str, stream: &str) -> Vec<(Uuid, String, i64)> {
    super::support::stream_messages(url, stream)
        .await
        .iter()
        .map(|message| {
            let event: Value = serde_json::from_slice(&message.payload).unwrap();
            (
                event["id"].as_str().unwrap().parse().unwrap(),
                event["subject"].as_str().unwrap().to_owned(),
                event["data"]["n"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// The `n`s of `subject`'s messages, in stream order.
fn stream_of(messages: &[(Uuid, String, i64)], subject: &str) -> Vec<i64> {
    messages
        .iter()
        .filter(|m| m.1 == subject)
        .map(|m| m.2)
        .collect()
}

// ---------------------------------------------------------------------------
// Rows, written as any SQL client writes them.

/// Inserts a row of `subject` with `data = {"n": n}`, with `traceparent`.
async fn insert(pool: &PgPool, subject: &str, n: i64, traceparent: Option<&str>) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data, traceparent)
         values ($1, $2, 'ctl-test', $3, now(), jsonb_build_object('n', $4::bigint), $5)",
    )
    .bind(id)
    .bind(EVENT_TYPE)
    .bind(subject)
    .bind(n)
    .bind(traceparent)
    .execute(pool)
    .await
    .unwrap();
    id
}

/// A subject whose first row (n = 0) can never be published, and `behind`
/// valid rows after it (n = 1..): returns (head, followers).
async fn blocked_subject(pool: &PgPool, subject: &str, behind: i64) -> (Uuid, Vec<Uuid>) {
    let head = insert(pool, subject, 0, Some(BAD_TRACEPARENT)).await;
    let mut followers = Vec::new();
    for n in 1..=behind {
        followers.push(insert(pool, subject, n, None).await);
    }
    (head, followers)
}

async fn published(pool: &PgPool, ids: &[Uuid]) -> i64 {
    sqlx::query_scalar(
        "select count(*) from outbox_events where id = any($1) and published_at is not null",
    )
    .bind(ids)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits until the parked heads are parked (at the cap, naming the fault),
/// the rows behind them deferred, and `healthy` published.
async fn wait_parked(
    relay: &Relay,
    pool: &PgPool,
    heads: &[Uuid],
    followers: &[Uuid],
    healthy: &[Uuid],
) {
    wait_until(
        "the bad heads parked, the rows behind them deferred, the others published",
        Duration::from_secs(60),
        || async {
            let parked: i64 = sqlx::query_scalar(
                "select count(*) from outbox_events where id = any($1) and published_at is null
                   and attempts >= 3 and next_attempt_at = 'infinity' and last_error is not null",
            )
            .bind(heads)
            .fetch_one(pool)
            .await
            .unwrap();
            let deferred: i64 = sqlx::query_scalar(
                "select count(*) from outbox_events where id = any($1) and published_at is null
                   and attempts = 0 and next_attempt_at is not null",
            )
            .bind(followers)
            .fetch_one(pool)
            .await
            .unwrap();
            parked == heads.len() as i64
                && deferred == followers.len() as i64
                && published(pool, healthy).await == healthy.len() as i64
        },
    )
    .await
    .unwrap_or_else(|e| relay.fail(e));
}

/// Waits until the relay session owns all 64 shards, as `status` reports it,
/// and returns that status.
async fn wait_shards(relay: &Relay, db: &TestDb) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(db).await;
        if s["shards_owned"] == 64 {
            return s;
        }
        if std::time::Instant::now() >= deadline {
            relay.fail(format!(
                "timed out after 30 s waiting for outboxctl status to show the relay with all 64 shards; last status: {s:#}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------
// 1. A parked head, reported, skipped; the skipped row kept.

#[tokio::test(flavor = "multi_thread")]
async fn a_parked_head_is_reported_and_skipped_and_its_subject_moves_on() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let pool = &db.pool;
    let mut healthy = Vec::new();
    for n in 0..5 {
        healthy.push(insert(pool, "acct-ok", n, None).await);
    }
    let (head, followers) = blocked_subject(pool, "acct-bad", 3).await;
    for n in 5..8 {
        healthy.push(insert(pool, "acct-ok", n, None).await);
    }

    let mut relay = Relay::start(&db, broker.url(), "CTL_SKIP").await;
    wait_parked(&relay, pool, &[head], &followers, &healthy).await;
    let s = wait_shards(&relay, &db).await;

    // status: the exact counts, the blocked subject, the relay session.
    let t = &s["totals"];
    assert_eq!(i(&s["max_attempts"]), 3);
    assert_eq!(i(&t["unpublished"]), 4, "{s:#}");
    assert_eq!(i(&t["fresh"]), 0, "{s:#}");
    assert_eq!(i(&t["in_backoff"]), 0, "{s:#}");
    assert_eq!(i(&t["deferred"]), 3, "{s:#}");
    assert_eq!(i(&t["parked"]), 1, "{s:#}");
    assert_eq!(i(&t["skipped"]), 0, "{s:#}");
    assert_eq!(i(&t["published_last_hour"]), 8, "{s:#}");
    assert!(t["oldest_unpublished_age_secs"].as_f64().unwrap() >= 0.0);
    let types = s["event_types"].as_array().unwrap();
    assert_eq!(types.len(), 1, "{s:#}");
    assert_eq!(types[0]["event_type"], EVENT_TYPE);
    assert_eq!(i(&types[0]["parked"]), 1);
    assert_eq!(i(&types[0]["published_last_hour"]), 8);
    let blocked = &s["blocked_subjects"];
    assert_eq!(i(&blocked["total"]), 1, "{s:#}");
    let b = &blocked["shown"][0];
    assert_eq!(b["subject"], "acct-bad");
    assert_eq!(b["head_id"], head.to_string());
    assert_eq!(i(&b["waiting"]), 3);
    assert_eq!(i(&b["attempts"]), 3);
    assert!(
        b["last_error"]
            .as_str()
            .unwrap()
            .to_lowercase()
            .contains("traceparent"),
        "{b:#}"
    );
    let relays = s["relays"].as_array().unwrap();
    assert_eq!(relays.len(), 1, "one relay session: {s:#}");
    let r = &relays[0];
    assert_eq!(r["application_name"], "outbox-relay shards", "{r:#}");
    assert_eq!(i(&r["workers"]), 2, "the relay's default --workers: {r:#}");
    let shards: Vec<i64> = r["shards"].as_array().unwrap().iter().map(i).collect();
    assert_eq!(shards, (0..64).collect::<Vec<_>>());
    assert!(r["pid"].as_i64().unwrap() > 0);
    assert!(r["backend_start"].is_string(), "{r:#}");
    assert_eq!(s["consumer_leaders"], serde_json::json!([]));

    // The text form says the same.
    let text = ctl(db.url(), &["status", "--max-attempts", MAX_ATTEMPTS]).await;
    assert!(text.status.success(), "{}", text.stderr);
    for needle in [
        "4 unpublished",
        "1 parked",
        "blocked subjects: 1",
        "acct-bad",
        "64 of 64 shards",
    ] {
        assert!(
            text.stdout.contains(needle),
            "{needle:?} in:\n{}",
            text.stdout
        );
    }

    // stuck: the head with its error; followers are deferred, not stuck.
    let stuck = ctl(
        db.url(),
        &["--json", "stuck", "--max-attempts", MAX_ATTEMPTS],
    )
    .await
    .ok();
    assert_eq!(i(&stuck["total"]), 1, "{stuck:#}");
    let row = &stuck["rows"][0];
    assert_eq!(row["id"], head.to_string());
    assert_eq!(row["subject"], "acct-bad");
    assert_eq!(row["state"], "parked");
    assert_eq!(i(&row["attempts"]), 3);
    assert!(
        row["last_error"]
            .as_str()
            .unwrap()
            .to_lowercase()
            .contains("traceparent"),
        "{row:#}"
    );
    let filtered = ctl(db.url(), &["--json", "stuck", "--entity", "acct-ok"])
        .await
        .ok();
    assert_eq!(i(&filtered["total"]), 0, "{filtered:#}");

    // skip: recorded, and the running relay publishes the rows behind it at
    // once (well within the 10 s deferral).
    let reason = "customer record deleted; compensated by hand (INC-42)";
    let skipped = ctl(
        db.url(),
        &[
            "--json",
            "skip",
            &head.to_string(),
            "--reason",
            reason,
            "--by",
            "alice@ops",
        ],
    )
    .await
    .ok();
    let role: String = sqlx::query_scalar("select current_user::text")
        .fetch_one(pool)
        .await
        .unwrap();
    let by = format!("alice@ops (role {role})");
    assert_eq!(skipped["id"], head.to_string());
    assert_eq!(skipped["skipped_by"], by.as_str());
    assert_eq!(skipped["reason"], reason);
    assert!(
        ids(&skipped["woken"])
            .iter()
            .all(|id| followers.contains(id))
    );
    let started = std::time::Instant::now();
    wait_until(
        "the rows behind the skipped head published",
        Duration::from_secs(30),
        || async { published(pool, &followers).await == 3 },
    )
    .await
    .unwrap_or_else(|e| relay.fail(e));
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "the rows behind the skipped row waited out their deferral ({:?}) instead of being woken",
        started.elapsed()
    );
    let messages = read_stream(broker.url(), &relay.stream).await;
    assert_eq!(stream_of(&messages, "acct-bad"), vec![1, 2, 3], "in order");
    assert_eq!(stream_of(&messages, "acct-ok"), (0..8).collect::<Vec<_>>());
    assert!(
        messages.iter().all(|m| m.0 != head),
        "the skipped row is not on the stream"
    );

    // The skipped row: kept, unpublished, who/when/why on it.
    type Time = Option<chrono::DateTime<chrono::Utc>>;
    let (published_at, skipped_at, skipped_by, skip_reason): (
        Time,
        Time,
        Option<String>,
        Option<String>,
    ) = sqlx::query_as(
        "select published_at, skipped_at, skipped_by, skip_reason from outbox_events where id = $1",
    )
    .bind(head)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(published_at, None);
    assert!(skipped_at.is_some());
    assert_eq!(skipped_by.as_deref(), Some(by.as_str()));
    assert_eq!(skip_reason.as_deref(), Some(reason));

    // status: no backlog, nothing blocked, one skipped.
    let s = status(&db).await;
    let t = &s["totals"];
    assert_eq!(i(&t["unpublished"]), 0, "{s:#}");
    assert_eq!(i(&t["parked"]), 0, "{s:#}");
    assert_eq!(i(&t["skipped"]), 1, "{s:#}");
    assert_eq!(i(&t["published_last_hour"]), 11, "{s:#}");
    assert_eq!(t["oldest_unpublished_age_secs"], Value::Null, "{s:#}");
    assert_eq!(i(&s["blocked_subjects"]["total"]), 0, "{s:#}");
    let stuck = ctl(db.url(), &["--json", "stuck"]).await.ok();
    assert_eq!(i(&stuck["total"]), 0, "{stuck:#}");

    // Skipping again, or retrying it, is refused naming who skipped it.
    for args in [
        vec!["--json", "skip", &head.to_string(), "--reason", "again"],
        vec!["--json", "retry", &head.to_string()],
    ] {
        let args: Vec<&str> = args.to_vec();
        let (kind, message) = ctl(db.url(), &args).await.error();
        assert_eq!(kind, "invalid_state");
        assert!(
            message.contains(&head.to_string()) && message.contains(&by),
            "{message}"
        );
    }

    // prune: every row published longer ago than the window goes, the
    // skipped row stays even when old (and published by a relay that raced
    // the skip), rows newer than the window stay.
    relay.stop().await;
    let old: i64 = 11;
    sqlx::query(
        "update outbox_events set published_at = now() - interval '30 days'
          where published_at is not null",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("update outbox_events set created_at = now() - interval '40 days' where id = $1")
        .bind(head)
        .execute(pool)
        .await
        .unwrap();
    let raced = insert(pool, "acct-raced", 0, None).await;
    sqlx::query(
        "update outbox_events set published_at = now() - interval '30 days', skipped_at = now(),
                skipped_by = 'bob', skip_reason = 'raced', next_attempt_at = null
          where id = $1",
    )
    .bind(raced)
    .execute(pool)
    .await
    .unwrap();
    let fresh = insert(pool, "acct-recent", 0, None).await;
    sqlx::query("update outbox_events set published_at = now() - interval '1 day' where id = $1")
        .bind(fresh)
        .execute(pool)
        .await
        .unwrap();
    let before = count_where(pool, "true").await;

    let dry = ctl(db.url(), &["--json", "prune", "--dry-run"]).await.ok();
    assert_eq!(i(&dry["deleted"]), old, "{dry:#}");
    assert_eq!(dry["dry_run"], true);
    assert_eq!(
        count_where(pool, "true").await,
        before,
        "--dry-run deleted rows"
    );

    // Through a pipe: the JSON alone on stdout, no progress bar on stderr.
    let pruned = ctl(db.url(), &["--json", "prune", "--batch", "4"]).await;
    assert!(pruned.stderr.is_empty(), "stderr: {:?}", pruned.stderr);
    let pruned = pruned.ok();
    assert_eq!(i(&pruned["deleted"]), old, "{pruned:#}");
    assert_eq!(pruned["dry_run"], false);
    assert_eq!(count_where(pool, "true").await, before - old);
    let kept: Vec<Uuid> = sqlx::query_scalar("select id from outbox_events order by id")
        .fetch_all(pool)
        .await
        .unwrap();
    let mut expected = vec![head, raced, fresh];
    expected.sort();
    assert_eq!(
        kept, expected,
        "only the skipped rows and the recent one are left"
    );
    let again = ctl(db.url(), &["--json", "prune"]).await.ok();
    assert_eq!(i(&again["deleted"]), 0);
    let wide = ctl(db.url(), &["--json", "prune", "--older-than", "1h"])
        .await
        .ok();
    assert_eq!(
        i(&wide["deleted"]),
        1,
        "the row published a day ago: {wide:#}"
    );
    assert_eq!(count_where(pool, &format!("id = '{head}'")).await, 1);
}

// ---------------------------------------------------------------------------
// 2. Retry after the cause is fixed.

#[tokio::test(flavor = "multi_thread")]
async fn retried_rows_are_published_by_the_running_relay_in_order() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let pool = &db.pool;
    let (head1, behind1) = blocked_subject(pool, "fix-1", 2).await;
    let (head2, behind2) = blocked_subject(pool, "fix-2", 2).await;
    let (head3, behind3) = blocked_subject(pool, "fix-3", 1).await;
    let (head4, behind4) = blocked_subject(pool, "fix-4", 0).await;
    let healthy = vec![insert(pool, "fine", 0, None).await];
    let heads = [head1, head2, head3, head4];
    let followers: Vec<Uuid> = [&behind1, &behind2, &behind3, &behind4]
        .into_iter()
        .flatten()
        .copied()
        .collect();
    let mut relay = Relay::start(&db, broker.url(), "CTL_RETRY").await;
    wait_parked(&relay, pool, &heads, &followers, &healthy).await;

    let s = status(&db).await;
    assert_eq!(i(&s["totals"]["parked"]), 4, "{s:#}");
    assert_eq!(i(&s["blocked_subjects"]["total"]), 4, "{s:#}");
    let waiting: Vec<(String, i64)> = s["blocked_subjects"]["shown"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (b["subject"].as_str().unwrap().to_owned(), i(&b["waiting"])))
        .collect();
    assert_eq!(
        waiting,
        [("fix-1", 2), ("fix-2", 2), ("fix-3", 1), ("fix-4", 0)]
            .map(|(s, n)| (s.to_owned(), n))
            .to_vec(),
        "most rows waiting first"
    );
    let limited = ctl(
        db.url(),
        &["--json", "status", "--blocked", "1", "--max-attempts", "3"],
    )
    .await
    .ok();
    assert_eq!(i(&limited["blocked_subjects"]["total"]), 4);
    assert_eq!(
        limited["blocked_subjects"]["shown"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    let stuck = ctl(db.url(), &["--json", "stuck", "--limit", "2"])
        .await
        .ok();
    assert_eq!(i(&stuck["total"]), 4, "the total, whatever the limit");
    assert_eq!(
        ids(&serde_json::json!(
            stuck["rows"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["id"].clone())
                .collect::<Vec<_>>()
        )),
        vec![head1, head2],
        "oldest first"
    );

    // An unknown id among good ones: refused, naming it; nothing changes.
    let unknown = Uuid::now_v7();
    let (kind, message) = ctl(
        db.url(),
        &["--json", "retry", &head1.to_string(), &unknown.to_string()],
    )
    .await
    .error();
    assert_eq!(kind, "not_found");
    assert!(message.contains(&unknown.to_string()), "{message}");
    assert_eq!(
        count_where(
            pool,
            &format!("id = '{head1}' and attempts = 3 and next_attempt_at = 'infinity'")
        )
        .await,
        1,
        "the good id was not retried"
    );
    // A published id: refused, saying when.
    let (kind, message) = ctl(db.url(), &["--json", "retry", &healthy[0].to_string()])
        .await
        .error();
    assert_eq!(kind, "invalid_state");
    assert!(message.contains("published at"), "{message}");

    // Fix the cause, then retry by id: the head goes, the rows behind it at once.
    sqlx::query("update outbox_events set traceparent = null where id = any($1)")
        .bind(&heads[..])
        .execute(pool)
        .await
        .unwrap();
    let r = ctl(db.url(), &["--json", "retry", &head1.to_string()])
        .await
        .ok();
    assert_eq!(ids(&r["retried"]), vec![head1], "{r:#}");
    assert_eq!(i(&r["already_claimable"]), 0);
    let mut subject1 = vec![head1];
    subject1.extend(&behind1);
    let started = std::time::Instant::now();
    wait_until("fix-1 published", Duration::from_secs(30), || async {
        published(pool, &subject1).await == 3
    })
    .await
    .unwrap_or_else(|e| relay.fail(e));
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "the rows behind the retried head waited out their deferral"
    );
    assert_eq!(
        count_where(pool, &format!("id = '{head1}' and last_error is null")).await,
        1,
        "the relay clears last_error on publish"
    );

    // --entity: the head and its deferred rows, all claimable now.
    let r = ctl(db.url(), &["--json", "retry", "--entity", "fix-2"])
        .await
        .ok();
    let mut retried = ids(&r["retried"]);
    retried.sort();
    let mut subject2 = vec![head2];
    subject2.extend(&behind2);
    let mut expected = subject2.clone();
    expected.sort();
    assert_eq!(retried, expected, "{r:#}");
    wait_until("fix-2 published", Duration::from_secs(30), || async {
        published(pool, &subject2).await == 3
    })
    .await
    .unwrap_or_else(|e| relay.fail(e));

    // --all-stuck: the remaining parked heads (not the rows deferred behind them).
    let r = ctl(db.url(), &["--json", "retry", "--all-stuck"])
        .await
        .ok();
    let mut retried = ids(&r["retried"]);
    retried.sort();
    let mut expected = vec![head3, head4];
    expected.sort();
    assert_eq!(retried, expected, "{r:#}");
    let rest: Vec<Uuid> = [head3, head4].into_iter().chain(behind3.clone()).collect();
    wait_until(
        "fix-3 and fix-4 published",
        Duration::from_secs(30),
        || async { published(pool, &rest).await == 3 },
    )
    .await
    .unwrap_or_else(|e| relay.fail(e));

    // In order per subject, each once.
    let messages = read_stream(broker.url(), &relay.stream).await;
    assert_eq!(stream_of(&messages, "fix-1"), vec![0, 1, 2]);
    assert_eq!(stream_of(&messages, "fix-2"), vec![0, 1, 2]);
    assert_eq!(stream_of(&messages, "fix-3"), vec![0, 1]);
    assert_eq!(stream_of(&messages, "fix-4"), vec![0]);
    assert_eq!(messages.len(), 10, "the nine and the healthy row");
    let s = status(&db).await;
    assert_eq!(i(&s["totals"]["unpublished"]), 0, "{s:#}");
    assert_eq!(i(&s["blocked_subjects"]["total"]), 0, "{s:#}");

    // A row in the main lane is claimable already: reported, not changed.
    relay.stop().await;
    let waiting = insert(pool, "later", 0, None).await;
    let r = ctl(db.url(), &["--json", "retry", &waiting.to_string()])
        .await
        .ok();
    assert_eq!(ids(&r["retried"]), Vec::<Uuid>::new(), "{r:#}");
    assert_eq!(ids(&r["already_claimable_ids"]), vec![waiting], "{r:#}");
    assert_eq!(
        count_where(
            pool,
            &format!("id = '{waiting}' and next_attempt_at is null")
        )
        .await,
        1
    );
}

// ---------------------------------------------------------------------------
// 3. Errors.

#[tokio::test(flavor = "multi_thread")]
async fn errors_are_one_line_exit_1_and_json_and_change_nothing() {
    // A closed port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let closed = format!("postgres://postgres@127.0.0.1:{port}/nothing");
    let started = std::time::Instant::now();
    let (kind, message) = ctl(&closed, &["--json", "status"]).await.error();
    assert_eq!(kind, "connect", "{message}");
    // The cause, at once: not a pool's timeout after retrying.
    assert!(message.contains("refused"), "{message}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    // A republish reaching past the consumers' inbox window: refused before
    // anything is read.
    let (kind, message) = ctl(
        &closed,
        &["--json", "audit", "--since", "15d", "--republish"],
    )
    .await
    .error();
    assert_eq!(kind, "config", "{message}");
    assert!(
        message.contains("inbox window") && message.contains("apply it again"),
        "{message}"
    );

    // A database without the tables: the missing table named, every command.
    let db = TestDb::new().await.unwrap();
    let empty_name = format!("{}_empty", db.name());
    let empty = outbox_testkit::create_database(db.url(), &empty_name)
        .await
        .unwrap();
    let some_id = Uuid::now_v7().to_string();
    for args in [
        vec!["--json", "status"],
        vec!["--json", "stuck"],
        vec!["--json", "retry", "--all-stuck"],
        vec!["--json", "skip", &some_id, "--reason", "x"],
        vec!["--json", "prune", "--dry-run"],
    ] {
        let (kind, message) = ctl(&empty, &args).await.error();
        assert_eq!(kind, "missing_table", "{args:?}: {message}");
        assert!(message.contains("outbox_events"), "{args:?}: {message}");
    }

    // Tables of a schema before the operations migration: told to migrate,
    // naming the column, not shown a failing statement.
    let old_name = format!("{}_old", db.name());
    let old = outbox_testkit::create_database(db.url(), &old_name)
        .await
        .unwrap();
    let old_pool = sqlx::PgPool::connect(&old).await.unwrap();
    sqlx::raw_sql(
        "create table outbox_events (id uuid primary key, event_type text not null, \
         source text not null, subject text not null, time timestamptz not null, \
         data jsonb not null, created_at timestamptz not null default now(), \
         published_at timestamptz, attempts int not null default 0)",
    )
    .execute(&old_pool)
    .await
    .unwrap();
    old_pool.close().await;
    let (kind, message) = ctl(&old, &["--json", "status"]).await.error();
    assert_eq!(kind, "missing_table", "{message}");
    assert!(
        message.contains("outbox_events.skipped_at") && message.contains("migrations"),
        "{message}"
    );

    // Unknown ids: named, nothing changed.
    let pool = &db.pool;
    let (head, _) = blocked_subject(pool, "e-1", 1).await;
    sqlx::query(
        "update outbox_events set attempts = 3, next_attempt_at = 'infinity' where id = $1",
    )
    .bind(head)
    .execute(pool)
    .await
    .unwrap();
    let unknown = Uuid::now_v7();
    let (kind, message) = ctl(
        db.url(),
        &["--json", "skip", &unknown.to_string(), "--reason", "gone"],
    )
    .await
    .error();
    assert_eq!(kind, "not_found");
    assert!(message.contains(&unknown.to_string()), "{message}");
    let (kind, message) = ctl(db.url(), &["--json", "retry", &unknown.to_string()])
        .await
        .error();
    assert_eq!(kind, "not_found");
    assert!(message.contains(&unknown.to_string()), "{message}");
    // Not an id at all, and an empty reason.
    let (kind, message) = ctl(db.url(), &["--json", "retry", "not-an-id"])
        .await
        .error();
    assert_eq!(kind, "config");
    assert!(message.contains("not-an-id"), "{message}");
    let (kind, message) = ctl(
        db.url(),
        &["--json", "skip", &head.to_string(), "--reason", " "],
    )
    .await
    .error();
    assert_eq!(kind, "config");
    assert!(message.contains("--reason"), "{message}");
    assert_eq!(count_where(pool, "skipped_at is not null").await, 0);
    assert_eq!(
        count_where(pool, "attempts = 3 and next_attempt_at = 'infinity'").await,
        1,
        "nothing was changed"
    );
    // Exactly one of ids, --entity, --all-stuck (a usage error: exit 2).
    let both = ctl(db.url(), &["retry", &head.to_string(), "--all-stuck"]).await;
    assert_eq!(both.status.code(), Some(2), "{}", both.stderr);
    let none = ctl(db.url(), &["retry"]).await;
    assert_eq!(none.status.code(), Some(2), "{}", none.stderr);
}

// ---------------------------------------------------------------------------
// 4. Every state counted, per event type, without a relay.

/// Inserts a row of `event_type` and `subject`, then sets `set` on it by SQL
/// (as the relay or an operator would have left it).
async fn row_in_state(pool: &PgPool, event_type: &str, subject: &str, set: &str) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         values ($1, $2, 'ctl-test', $3, now(), '{}')",
    )
    .bind(id)
    .bind(event_type)
    .bind(subject)
    .execute(pool)
    .await
    .unwrap();
    if !set.is_empty() {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "update outbox_events set {set} where id = $1"
        )))
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    }
    id
}

#[tokio::test(flavor = "multi_thread")]
async fn status_and_stuck_count_each_state_per_event_type() {
    let db = TestDb::new().await.unwrap();
    let pool = &db.pool;
    const BACKOFF: &str =
        "attempts = 2, next_attempt_at = now() + interval '1 hour', last_error = 'refused'";
    const DEFERRED: &str = "next_attempt_at = now() + interval '1 hour'";
    const PARKED: &str = "attempts = 5, next_attempt_at = 'infinity', last_error = 'bad row'";
    const SKIPPED: &str =
        "next_attempt_at = 'infinity', skipped_at = now(), skipped_by = 'x', skip_reason = 'y'";
    // a.one: two fresh rows, one in backoff, one parked with two rows behind it.
    row_in_state(pool, "a.one", "s-1", "").await;
    row_in_state(pool, "a.one", "s-2", "").await;
    let backoff = row_in_state(pool, "a.one", "s-3", BACKOFF).await;
    let parked = row_in_state(pool, "a.one", "s-4", PARKED).await;
    let deferred = row_in_state(pool, "a.one", "s-4", DEFERRED).await;
    row_in_state(pool, "a.one", "s-4", "").await;
    // b.two: one at the cap of 3 but due (parked by a relay with --max-attempts 3),
    // one skipped, one published a minute ago, one published two hours ago.
    let capped = row_in_state(
        pool,
        "b.two",
        "s-5",
        "attempts = 3, next_attempt_at = now(), last_error = 'refused'",
    )
    .await;
    row_in_state(pool, "b.two", "s-6", SKIPPED).await;
    row_in_state(
        pool,
        "b.two",
        "s-7",
        "published_at = now() - interval '1 minute'",
    )
    .await;
    row_in_state(
        pool,
        "b.two",
        "s-8",
        "published_at = now() - interval '2 hours'",
    )
    .await;
    sqlx::query("update outbox_events set created_at = now() - interval '1 hour' where id = $1")
        .bind(parked)
        .execute(pool)
        .await
        .unwrap();

    let s = status(&db).await;
    let counts = |v: &Value| {
        [
            "unpublished",
            "fresh",
            "in_backoff",
            "deferred",
            "parked",
            "skipped",
            "published_last_hour",
        ]
        .map(|k| i(&v[k]))
    };
    assert_eq!(counts(&s["totals"]), [7, 3, 1, 1, 2, 1, 1], "{s:#}");
    let types = s["event_types"].as_array().unwrap();
    assert_eq!(types[0]["event_type"], "a.one");
    assert_eq!(counts(&types[0]), [6, 3, 1, 1, 1, 0, 0], "{s:#}");
    assert_eq!(types[1]["event_type"], "b.two");
    assert_eq!(counts(&types[1]), [1, 0, 0, 0, 1, 1, 1], "{s:#}");
    let oldest = s["totals"]["oldest_unpublished_age_secs"].as_f64().unwrap();
    assert!(
        (3500.0..4000.0).contains(&oldest),
        "the parked row's hour: {oldest}"
    );
    let blocked: Vec<(String, i64)> = s["blocked_subjects"]["shown"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (b["subject"].as_str().unwrap().to_owned(), i(&b["waiting"])))
        .collect();
    assert_eq!(
        blocked,
        vec![("s-4".to_owned(), 2), ("s-5".to_owned(), 0)],
        "{s:#}"
    );
    assert_eq!(s["relays"], serde_json::json!([]));

    // With the default cap of 20, the row at 3 attempts is in backoff, not parked.
    let default_cap = ctl(db.url(), &["--json", "status"]).await.ok();
    assert_eq!(i(&default_cap["totals"]["parked"]), 1, "{default_cap:#}");
    assert_eq!(
        i(&default_cap["totals"]["in_backoff"]),
        2,
        "{default_cap:#}"
    );

    // stuck: the three failing or parked rows, oldest first, with their states.
    let stuck = ctl(
        db.url(),
        &["--json", "stuck", "--max-attempts", MAX_ATTEMPTS],
    )
    .await
    .ok();
    let rows: Vec<(Uuid, String)> = stuck["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap().parse().unwrap(),
                r["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (parked, "parked".to_owned()),
            (backoff, "backoff".to_owned()),
            (capped, "parked".to_owned()),
        ],
        "{stuck:#}"
    );
    assert!(stuck["rows"][1]["next_attempt_at"].is_string(), "{stuck:#}");
    assert_eq!(i(&stuck["total"]), 3);
    let by_type = ctl(db.url(), &["--json", "stuck", "--type", "b.two"])
        .await
        .ok();
    assert_eq!(
        ids(&serde_json::json!([by_type["rows"][0]["id"]])),
        vec![capped]
    );
    assert_eq!(i(&by_type["total"]), 1);
    let text = ctl(db.url(), &["stuck", "--limit", "1"]).await;
    assert!(
        text.stdout.contains("1 of 3 stuck rows shown"),
        "{}",
        text.stdout
    );
    // The deferred row is not stuck itself; --entity retries it with its head.
    let r = ctl(db.url(), &["--json", "retry", "--entity", "s-4"])
        .await
        .ok();
    let mut retried = ids(&r["retried"]);
    retried.sort();
    let mut expected = vec![parked, deferred];
    expected.sort();
    assert_eq!(retried, expected, "{r:#}");
    assert_eq!(i(&r["already_claimable"]), 1, "the fresh row behind them");
    assert_eq!(
        count_where(
            pool,
            &format!("id = '{parked}' and attempts = 0 and next_attempt_at <= now() and last_error = 'bad row'")
        )
        .await,
        1,
        "retried: no attempts, due now, its last error kept"
    );

    // skip without --by: $USER at this host, with the database role.
    let skipped = ctl_with(
        db.url(),
        &[
            "--json",
            "skip",
            &backoff.to_string(),
            "--reason",
            "duplicate of another event",
        ],
        &[("USER", "carol"), ("LOGNAME", "not-this")],
    )
    .await
    .ok();
    let by = skipped["skipped_by"].as_str().unwrap();
    let role: String = sqlx::query_scalar("select current_user::text")
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(
        by.starts_with("carol@") && by.ends_with(&format!(" (role {role})")) && by.len() > 7,
        "{by}"
    );
    let recorded: Option<String> =
        sqlx::query_scalar("select skipped_by from outbox_events where id = $1")
            .bind(backoff)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(recorded.as_deref(), Some(by));
}

// ---------------------------------------------------------------------------
// 5. The progress bar, on a terminal only.

#[tokio::test(flavor = "multi_thread")]
async fn prune_draws_a_progress_bar_on_a_terminal() {
    let db = TestDb::new().await.unwrap();
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data, published_at)
         select gen_random_uuid(), 'p.old', 'ctl-test', 's-' || i, now(), '{}', now() - interval '30 days'
           from generate_series(1, 3000) as i",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // util-linux `script` gives the command a pseudo-terminal and copies what
    // it draws to our stdout.
    let command = format!(
        "{} prune --batch 100 --database-url '{}'",
        ctl_path().display(),
        db.url()
    );
    let out = tokio::process::Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env_remove("DATABASE_URL")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("util-linux `script` runs a command on a pseudo-terminal");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("pruning"), "no progress bar drawn: {text:?}");
    assert!(text.contains("deleted 3000 published rows"), "{text:?}");
    assert_eq!(count_where(&db.pool, "true").await, 0);
}
