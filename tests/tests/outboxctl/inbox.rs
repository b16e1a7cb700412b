//! `outboxctl inbox …` and `outboxctl dead-letters …` run as an operator runs
//! them, against real PostgreSQL and nats-server, their `--json` parsed:
//!
//! - three consumers of one stream (one at a time, batched, ordered), the
//!   first rejecting an event while a row of its database says so: the event
//!   is dead-lettered there and handled by the others; `list` and `show`
//!   show it; once the flag is cleared, `replay` has the first consumer apply
//!   it exactly once under its original id, the other two ack it without
//!   handling it (their inbox rows of it were deleted first, so only the
//!   replay header keeps them from applying it again; counted in
//!   `inbox_replays_ignored_total`), and a second replay
//!   is a duplicate in the inbox (`replay_count` 2);
//! - `inbox status` counts, `inbox prune` and `dead-letters purge` on rows
//!   set back in time (`--dry-run` first), a short prune window refused
//!   without `--force`;
//! - errors: an unknown dead-letter id (nothing published), a replay whose
//!   subject another stream stores, NATS not reachable, a wrong database URL
//!   and a database without the tables, each one line and exit status 1;
//! - `inbox owners` and `inbox set-owner`: a consumer name claimed before its
//!   consumer starts, one handed over, the refusals, and a consumer's role
//!   (under row-level security) warned or refused.
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use inbox_consumer::metrics::names::REPLAYS_IGNORED;
use inbox_consumer::prelude::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use outbox_testkit::{TestDb, wait_until};

use super::support::count;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::PgTransaction;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(30);

/// The event the consumers of the main test handle.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
struct Thing {
    n: i64,
}

impl Event for Thing {
    const TYPE: &'static str = "octlinbox.thing";
}

/// Records `(consumer, event id, n)` in `applied`, unless `refuse` holds
/// `(consumer, n)`: then rejects the event (a dead letter).
#[derive(Clone)]
struct Apply {
    consumer: &'static str,
}

impl Handler for Apply {
    type Message = Thing;

    async fn handle(
        &self,
        event: Envelope<Thing>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        let n = event.data().n;
        let refused: bool = sqlx::query_scalar(
            "select exists (select 1 from refuse where consumer = $1 and n = $2)",
        )
        .bind(self.consumer)
        .bind(n)
        .fetch_one(&mut **tx)
        .await?;
        if refused {
            return Err(HandlerError::reject(format!(
                "flagged: {} refuses thing {n}",
                self.consumer
            )));
        }
        sqlx::query("insert into applied (consumer, event_id, n) values ($1, $2, $3)")
            .bind(self.consumer)
            .bind(*event.id().as_uuid())
            .bind(n)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

fn snapshotter() -> &'static Snapshotter {
    static SNAP: OnceLock<Snapshotter> = OnceLock::new();
    SNAP.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::set_global_recorder(recorder).unwrap();
        snapshotter
    })
}

/// `inbox_replays_ignored_total` per consumer of this process, counted
/// since the last call (a snapshot resets the debugging recorder's counters).
fn replays_ignored() -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        if key.key().name() != REPLAYS_IGNORED {
            continue;
        }
        let DebugValue::Counter(n) = value else {
            continue;
        };
        for label in key.key().labels().filter(|l| l.key() == "consumer") {
            *counts.entry(label.value().to_owned()).or_default() += n;
        }
    }
    counts.retain(|_, n| *n > 0);
    counts
}

/// What a finished `outboxctl` printed.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The `--json` document of a successful run.
    fn json(&self) -> Value {
        assert_eq!(
            self.code,
            Some(0),
            "outboxctl failed\nstdout: {}\nstderr: {}",
            self.stdout,
            self.stderr
        );
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.stdout))
    }

    /// A failed run: exit status 1, one line on stderr (returned), and with
    /// `--json` an error object of `kind` on stdout.
    fn failure(&self, kind: &str) -> String {
        assert_eq!(
            self.code,
            Some(1),
            "expected a failure\nstdout: {}\nstderr: {}",
            self.stdout,
            self.stderr
        );
        let line = self.stderr.trim_end();
        assert!(
            !line.contains('\n'),
            "the error is not one line:\n{}",
            self.stderr
        );
        assert!(!line.contains("panicked"), "{line}");
        assert!(line.starts_with("outboxctl: "), "{line}");
        let error: Value = serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("no JSON error ({e}): {}", self.stdout));
        assert_eq!(error["error"]["kind"], kind, "{error}");
        line.to_owned()
    }
}

/// `target/debug/outboxctl`, next to this test executable's `deps/`.
fn outboxctl_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("outboxctl");
    assert!(
        bin.is_file(),
        "{} is missing: build the binaries first with `cargo build --workspace --bins` (scripts/test does)",
        bin.display()
    );
    bin
}

/// Runs `outboxctl --json <args>` on `database_url` to completion.
async fn outboxctl(database_url: &str, args: &[&str]) -> Run {
    let mut json = vec!["--json"];
    json.extend_from_slice(args);
    outboxctl_text(database_url, &json).await
}

/// Runs `outboxctl <args>` (text for people, unless `args` say `--json`).
async fn outboxctl_text(database_url: &str, args: &[&str]) -> Run {
    let out = tokio::process::Command::new(outboxctl_bin())
        .args(args)
        .env("DATABASE_URL", database_url)
        .env_remove("DATABASE_URL_FILE")
        .env_remove("NATS_URL")
        .env("RUST_BACKTRACE", "1")
        .output()
        .await
        .unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn execute(db: &TestDb, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&db.pool)
        .await
        .unwrap();
}

/// A CloudEvent as any producer writes it, published with its id as the
/// message id and an extra header; returns its id.
async fn publish_thing(js: &jetstream::Context, n: i64) -> Uuid {
    let id = Uuid::now_v7();
    let body = json!({
        "specversion": "1.0",
        "id": id.to_string(),
        "source": "octl-test",
        "type": Thing::TYPE,
        "subject": format!("thing-{n}"),
        "time": "2026-12-01T00:00:00Z",
        "datacontenttype": "application/json",
        "data": {"n": n},
    });
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", id.to_string().as_str());
    headers.insert("x-origin", "octl-test");
    js.publish_with_headers(
        Thing::TYPE,
        headers,
        serde_json::to_vec(&body).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    id
}

/// Messages in `stream`.
async fn messages(js: &jetstream::Context, stream: &str) -> u64 {
    let mut stream = js.get_stream(stream).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// Whether `durable` has acked everything up to stream sequence `sequence`.
async fn settled(js: &jetstream::Context, stream: &str, durable: &str, sequence: u64) -> bool {
    let Ok(stream) = js.get_stream(stream).await else {
        return false;
    };
    let Ok(info) = stream.consumer_info(durable).await else {
        return false;
    };
    info.num_pending == 0 && info.num_ack_pending == 0 && info.ack_floor.stream_sequence >= sequence
}

/// The consumer object of `consumer` in `inbox status --json`.
fn status_of<'a>(status: &'a Value, consumer: &str) -> &'a Value {
    status["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer"] == consumer)
        .unwrap_or_else(|| panic!("no {consumer} in {status}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_is_replayed_to_its_consumer_only_and_applied_once() {
    snapshotter();
    let mut scene = ReplayScene::start().await;
    let id = scene.dead_letter_is_listed_and_shown().await;
    scene.inbox_status_counts_each_consumer().await;
    scene.people_read_aligned_tables(id).await;
    scene.replay_is_applied_by_its_consumer_only(id).await;
    scene.a_second_replay_is_a_duplicate(id).await;
    scene.stop_consumers().await;
    scene.inbox_prune_deletes_old_rows().await;
    scene.dead_letters_purge_deletes_old_letters().await;
}

/// The stream of [`ReplayScene`].
const REPLAY_STREAM: &str = "OCTL_INBOX_REPLAY";

/// Three consumers of one stream (alpha one at a time, beta batched, gamma
/// ordered: the replay header is honoured on every path), alpha refusing
/// thing 2 (`e2`), which is dead-lettered.
struct ReplayScene {
    js: jetstream::Context,
    stop: CancellationToken,
    consumers: Vec<tokio::task::JoinHandle<inbox_consumer::Result<()>>>,
    e1: Uuid,
    e2: Uuid,
    nats: outbox_testkit::NatsHandle,
    db: TestDb,
}

impl ReplayScene {
    /// The tables, the stream, the consumers, and three events they have
    /// all settled: alpha applied two, beta and gamma three each.
    async fn start() -> Self {
        let db = TestDb::new().await.unwrap();
        execute(
            &db,
            "create table applied (consumer text not null, event_id uuid not null, n bigint not null);
             create table refuse (consumer text not null, n bigint not null);
             insert into refuse values ('alpha', 2);",
        )
        .await;
        let nats = outbox_testkit::nats().unwrap();
        let client = async_nats::connect(nats.url()).await.unwrap();
        let js = jetstream::new(client.clone());
        js.create_stream(stream::Config {
            name: REPLAY_STREAM.into(),
            subjects: vec!["octlinbox.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();

        let stop = CancellationToken::new();
        let builder = |durable: &'static str| {
            Consumer::builder(db.pool.clone(), client.clone(), REPLAY_STREAM, durable)
                .handler(Apply { consumer: durable })
                .stream_patience(WAIT)
        };
        let consumers = vec![
            tokio::spawn(builder("alpha").run(stop.clone().cancelled_owned())),
            tokio::spawn(
                builder("beta")
                    .batched(8)
                    .run(stop.clone().cancelled_owned()),
            ),
            tokio::spawn(
                builder("gamma")
                    .configure(|c| c.ordered(true))
                    .run(stop.clone().cancelled_owned()),
            ),
        ];

        let e1 = publish_thing(&js, 1).await;
        let e2 = publish_thing(&js, 2).await;
        publish_thing(&js, 3).await;
        let scene = Self {
            js,
            stop,
            consumers,
            e1,
            e2,
            nats,
            db,
        };
        scene.wait_settled("finish the three events", 3).await;
        assert_eq!(
            count(
                &scene.db.pool,
                "select count(*) from applied where consumer = 'alpha'"
            )
            .await,
            2
        );
        assert_eq!(
            count(
                &scene.db.pool,
                "select count(*) from applied where consumer in ('beta', 'gamma')"
            )
            .await,
            6
        );
        scene
    }

    fn url(&self) -> &str {
        self.db.url()
    }

    /// Waits until every consumer has acked the stream up to `sequence`.
    async fn wait_settled(&self, what: &str, sequence: u64) {
        for durable in ["alpha", "beta", "gamma"] {
            wait_until(&format!("{durable} to {what}"), WAIT, || {
                settled(&self.js, REPLAY_STREAM, durable, sequence)
            })
            .await
            .unwrap();
        }
    }

    /// `dead-letters list` and `show`: the one dead letter, alpha's, of
    /// `e2`; its id.
    async fn dead_letter_is_listed_and_shown(&self) -> i64 {
        let (url, e2) = (self.url(), self.e2);
        let list = outboxctl(url, &["dead-letters", "list"]).await.json();
        assert_eq!(list["total"], 1, "{list}");
        let letter = &list["dead_letters"][0];
        assert_eq!(letter["consumer"], "alpha");
        assert_eq!(letter["event_id"], e2.to_string());
        assert_eq!(letter["reason"], "rejected");
        assert_eq!(letter["stream"], REPLAY_STREAM);
        assert_eq!(letter["replay_count"], 0);
        assert!(letter["replayed_at"].is_null());
        let id = letter["id"].as_i64().unwrap();
        let none = outboxctl(url, &["dead-letters", "list", "--consumer", "beta"])
            .await
            .json();
        assert_eq!(none["total"], 0, "{none}");
        let by_reason = outboxctl(url, &["dead-letters", "list", "--reason", "rejected"])
            .await
            .json();
        assert_eq!(by_reason["total"], 1, "{by_reason}");

        let show = outboxctl(url, &["dead-letters", "show", &id.to_string()])
            .await
            .json();
        assert_eq!(show["id"], id);
        assert_eq!(show["payload"]["encoding"], "json", "{show}");
        assert_eq!(show["payload"]["value"]["id"], e2.to_string());
        assert_eq!(show["payload"]["value"]["data"]["n"], 2);
        assert_eq!(show["headers"]["x-origin"], json!(["octl-test"]), "{show}");
        assert_eq!(show["headers"]["Nats-Msg-Id"], json!([e2.to_string()]));
        assert!(
            show["error"]
                .as_str()
                .unwrap()
                .contains("alpha refuses thing 2"),
            "{show}"
        );
        id
    }

    /// `inbox status`: rows per consumer, alpha's dead letter, gamma's lease.
    async fn inbox_status_counts_each_consumer(&self) {
        let url = self.url();
        let status = outboxctl(url, &["inbox", "status"]).await.json();
        let alpha = status_of(&status, "alpha");
        assert_eq!(alpha["inbox"]["rows"], 2, "{status}");
        assert_eq!(alpha["dead_letters"]["total"], 1);
        assert_eq!(alpha["dead_letters"]["not_replayed"], 1);
        assert!(alpha["lease"].is_null());
        assert!(alpha["inbox"]["oldest_handled_at"].is_string());
        assert_eq!(status_of(&status, "beta")["inbox"]["rows"], 3);
        assert_eq!(status_of(&status, "beta")["dead_letters"]["total"], 0);
        let gamma = status_of(&status, "gamma");
        assert_eq!(gamma["inbox"]["rows"], 3);
        assert!(gamma["lease"]["epoch"].as_i64().unwrap() >= 1, "{status}");
        assert!(gamma["lease"]["holder"].is_string());
        let only = outboxctl(url, &["inbox", "status", "--consumer", "beta"])
            .await
            .json();
        assert_eq!(only["consumers"].as_array().unwrap().len(), 1, "{only}");
        let unknown = outboxctl(url, &["inbox", "status", "--consumer", "nobody"]).await;
        let line = unknown.failure("not_found");
        assert!(
            line.contains("`nobody`") && line.contains("alpha"),
            "{line}"
        );
    }

    /// The same for people: aligned tables.
    async fn people_read_aligned_tables(&self, id: i64) {
        for args in [
            &["inbox", "status"][..],
            &["dead-letters", "list"],
            &["dead-letters", "show", &id.to_string()],
        ] {
            let text = outboxctl_text(self.url(), args).await;
            assert_eq!(text.code, Some(0), "{}", text.stderr);
            println!("$ outboxctl {}\n{}", args.join(" "), text.stdout);
            assert!(text.stdout.contains("alpha"), "{}", text.stdout);
            assert!(serde_json::from_str::<Value>(&text.stdout).is_err());
        }
    }

    /// `--nats-url` of the scene's server.
    fn nats_url(&self) -> String {
        format!("--nats-url={}", self.nats.url())
    }

    /// `dead-letters replay`: alpha applies `e2` once under its original id;
    /// beta and gamma, whose inbox rows of it are deleted first (only the
    /// replay header keeps them from applying it again), ack it unhandled.
    async fn replay_is_applied_by_its_consumer_only(&self, id: i64) {
        let (db, url, e2) = (&self.db, self.url(), self.e2);
        execute(
            db,
            &format!(
                "delete from inbox_events where consumer in ('beta', 'gamma') and event_id = '{e2}'"
            ),
        )
        .await;
        execute(db, "delete from refuse").await;
        assert_eq!(messages(&self.js, REPLAY_STREAM).await, 3);

        let replay = outboxctl(
            url,
            &["dead-letters", "replay", &id.to_string(), &self.nats_url()],
        )
        .await
        .json();
        let replayed = &replay["replayed"][0];
        assert_eq!(replayed["id"], id, "{replay}");
        assert_eq!(replayed["consumer"], "alpha");
        assert_eq!(replayed["event_id"], e2.to_string());
        assert_eq!(replayed["msg_id"], format!("replay:alpha:{id}:1"));
        assert_eq!(replayed["stream_sequence"], 4);
        assert_eq!(replayed["duplicate"], false);
        assert_eq!(replayed["replay_count"], 1);
        assert!(replayed["replayed_at"].is_string());

        wait_until("alpha to apply the replayed event", WAIT, || async {
            count(
                &db.pool,
                &format!(
                    "select count(*) from applied where consumer = 'alpha' and event_id = '{e2}'"
                ),
            )
            .await
                == 1
        })
        .await
        .unwrap();
        self.wait_settled("ack the replay", 4).await;
        // alpha's inbox holds the original id; beta and gamma neither applied
        // nor recorded it again.
        assert_eq!(
            count(
                &db.pool,
                &format!(
                    "select count(*) from inbox_events where consumer = 'alpha' and event_id = '{e2}'"
                ),
            )
            .await,
            1
        );
        for durable in ["beta", "gamma"] {
            assert_eq!(
                count(
                    &db.pool,
                    &format!(
                        "select count(*) from applied where consumer = '{durable}' and event_id = '{e2}'"
                    ),
                )
                .await,
                1,
                "{durable} applied the replay meant for alpha"
            );
            assert_eq!(
                count(
                    &db.pool,
                    &format!(
                        "select count(*) from inbox_events where consumer = '{durable}' and event_id = '{e2}'"
                    ),
                )
                .await,
                0,
                "{durable} handled the replay meant for alpha"
            );
        }
        assert_eq!(replays_ignored(), Self::ignored());
    }

    /// Replays beta and gamma ignored, counted.
    fn ignored() -> BTreeMap<String, u64> {
        BTreeMap::from([("beta".to_owned(), 1), ("gamma".to_owned(), 1)])
    }

    /// Again, on purpose: a new message id gets it into the stream; alpha's
    /// inbox finds it a duplicate.
    async fn a_second_replay_is_a_duplicate(&self, id: i64) {
        let (db, url, e2) = (&self.db, self.url(), self.e2);
        let again = outboxctl(
            url,
            &["dead-letters", "replay", &id.to_string(), &self.nats_url()],
        )
        .await
        .json();
        assert_eq!(again["replayed"][0]["replay_count"], 2, "{again}");
        assert_eq!(
            again["replayed"][0]["msg_id"],
            format!("replay:alpha:{id}:2")
        );
        assert_eq!(again["replayed"][0]["stream_sequence"], 5);
        self.wait_settled("ack the second replay", 5).await;
        assert_eq!(
            count(
                &db.pool,
                &format!("select count(*) from applied where event_id = '{e2}'")
            )
            .await,
            3,
            "one effect per consumer"
        );
        assert_eq!(
            count(&db.pool, "select count(*) from inbox_dead_letters").await,
            1
        );
        assert_eq!(
            replays_ignored(),
            Self::ignored(),
            "the second replay, ignored again"
        );
        let list = outboxctl(url, &["dead-letters", "list"]).await.json();
        assert_eq!(list["dead_letters"][0]["replay_count"], 2, "{list}");
        let status = outboxctl(url, &["inbox", "status", "--consumer", "alpha"])
            .await
            .json();
        assert_eq!(status_of(&status, "alpha")["inbox"]["rows"], 3, "{status}");
        assert_eq!(
            status_of(&status, "alpha")["dead_letters"]["not_replayed"],
            0
        );
    }

    /// Stops the consumers, each of which ends without an error.
    async fn stop_consumers(&mut self) {
        self.stop.cancel();
        for consumer in self.consumers.drain(..) {
            consumer.await.unwrap().unwrap();
        }
    }

    /// `inbox prune`: alpha's `e1` row set back 20 days; the default window
    /// is 14, a short one is refused without `--force`.
    async fn inbox_prune_deletes_old_rows(&self) {
        let (db, url, e1) = (&self.db, self.url(), self.e1);
        execute(
            db,
            &format!(
                "update inbox_events set handled_at = now() - interval '20 days'
                  where consumer = 'alpha' and event_id = '{e1}'"
            ),
        )
        .await;
        let inbox_rows = "select count(*) from inbox_events";
        let before = count(&db.pool, inbox_rows).await;
        let dry = outboxctl(url, &["inbox", "prune", "--dry-run"])
            .await
            .json();
        assert_eq!(dry["dry_run"], true, "{dry}");
        assert_eq!(dry["total"], 1);
        assert_eq!(dry["older_than_seconds"], 14.0 * 86_400.0);
        let alpha = dry["consumers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["consumer"] == "alpha")
            .unwrap();
        assert_eq!(alpha["would_delete"], 1, "{dry}");
        assert_eq!(
            count(&db.pool, inbox_rows).await,
            before,
            "a dry run deletes nothing"
        );
        let pruned = outboxctl(url, &["inbox", "prune"]).await.json();
        assert_eq!(pruned["total"], 1, "{pruned}");
        assert_eq!(count(&db.pool, inbox_rows).await, before - 1);
        assert_eq!(
            count(
                &db.pool,
                &format!(
                    "select count(*) from inbox_events where event_id = '{e1}' and consumer = 'alpha'"
                )
            )
            .await,
            0
        );
        let short = outboxctl(url, &["inbox", "prune", "--older-than", "10m"]).await;
        let line = short.failure("config");
        assert!(line.contains("--force"), "{line}");
        assert_eq!(count(&db.pool, inbox_rows).await, before - 1);
        let forced = outboxctl(
            url,
            &[
                "inbox",
                "prune",
                "--older-than",
                "10m",
                "--force",
                "--dry-run",
                "--consumer",
                "beta",
            ],
        )
        .await
        .json();
        assert_eq!(forced["consumers"][0]["consumer"], "beta", "{forced}");
        assert_eq!(forced["consumers"][0]["would_delete"], 0);
    }

    /// `dead-letters purge`: the dead letter set back 40 days.
    async fn dead_letters_purge_deletes_old_letters(&self) {
        let (db, url) = (&self.db, self.url());
        execute(
            db,
            "update inbox_dead_letters set created_at = now() - interval '40 days'",
        )
        .await;
        let keep = outboxctl(url, &["dead-letters", "purge", "--older-than", "60d"])
            .await
            .json();
        assert_eq!(keep["total"], 0, "{keep}");
        let dry = outboxctl(
            url,
            &["dead-letters", "purge", "--older-than", "30d", "--dry-run"],
        )
        .await
        .json();
        assert_eq!(dry["total"], 1, "{dry}");
        assert_eq!(dry["consumers"][0]["consumer"], "alpha");
        assert_eq!(dry["consumers"][0]["would_delete"], 1);
        assert_eq!(
            count(&db.pool, "select count(*) from inbox_dead_letters").await,
            1
        );
        let purged = outboxctl(url, &["dead-letters", "purge", "--older-than", "30d"])
            .await
            .json();
        assert_eq!(purged["total"], 1, "{purged}");
        assert_eq!(purged["consumers"][0]["deleted"], 1);
        assert_eq!(
            count(&db.pool, "select count(*) from inbox_dead_letters").await,
            0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_one_line_and_publish_nothing() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let stream_name = "OCTL_INBOX_ERRORS";
    js.create_stream(stream::Config {
        name: stream_name.into(),
        subjects: vec!["octlinboxerr.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    // A dead letter of this stream, and one recorded as another stream's
    // although this stream stores its subject now.
    let insert = |stream: &str| {
        format!(
            "insert into inbox_dead_letters
               (consumer, stream, stream_sequence, subject, event_id, delivery_count, reason, error, headers, payload)
             values ('x', '{stream}', 1, 'octlinboxerr.a', null, 1, 'not_json', 'not JSON',
                     '{{\"Nats-Msg-Id\": [\"m1\"]}}', '\\xfffe00'::bytea)
             returning id"
        )
    };
    let id = count(&db.pool, &insert(stream_name)).await;
    let moved = count(&db.pool, &insert("ELSEWHERE")).await;
    let url = db.url();
    let nats_url = format!("--nats-url={}", nats.url());

    // show: binary payload in base64.
    let show = outboxctl(url, &["dead-letters", "show", &id.to_string()])
        .await
        .json();
    assert_eq!(show["payload"]["encoding"], "base64", "{show}");
    assert_eq!(show["payload"]["value"], "//4A");

    // An unknown id among known ones: named, nothing published.
    let run = outboxctl(
        url,
        &[
            "dead-letters",
            "replay",
            &id.to_string(),
            "987654",
            &nats_url,
        ],
    )
    .await;
    let line = run.failure("not_found");
    assert!(line.contains("987654"), "{line}");
    assert!(!line.contains(&format!("{id},")), "{line}");
    assert_eq!(messages(&js, stream_name).await, 0, "nothing published");
    assert_eq!(
        count(
            &db.pool,
            "select coalesce(sum(replay_count), 0)::bigint from inbox_dead_letters"
        )
        .await,
        0
    );
    let line = outboxctl(url, &["dead-letters", "show", "987654"])
        .await
        .failure("not_found");
    assert!(line.contains("987654"), "{line}");

    // The subject is stored by another stream than the dead letter's.
    let line = outboxctl(
        url,
        &["dead-letters", "replay", &moved.to_string(), &nats_url],
    )
    .await
    .failure("invalid_state");
    assert!(
        line.contains(stream_name) && line.contains("ELSEWHERE"),
        "{line}"
    );
    assert_eq!(
        count(
            &db.pool,
            &format!("select replay_count::bigint from inbox_dead_letters where id = {moved}")
        )
        .await,
        0
    );

    // NATS not reachable.
    let line = outboxctl(
        url,
        &[
            "dead-letters",
            "replay",
            &id.to_string(),
            "--nats-url=nats://127.0.0.1:1",
            "--timeout=3s",
        ],
    )
    .await
    .failure("nats");
    assert!(line.contains("127.0.0.1:1"), "{line}");

    // A database that cannot be reached.
    let line = outboxctl(
        "postgres://nobody:secret@127.0.0.1:1/none",
        &["inbox", "status"],
    )
    .await
    .failure("connect");
    assert!(!line.contains("secret"), "{line}");
    let line = outboxctl(
        "postgres://nobody@127.0.0.1:1/none",
        &["dead-letters", "list"],
    )
    .await
    .failure("connect");
    assert!(!line.is_empty());

    // A database without the tables.
    let bare_name = format!("{}_bare", db.name());
    let bare = outbox_testkit::create_database(url, &bare_name)
        .await
        .unwrap();
    let line = outboxctl(&bare, &["inbox", "status"])
        .await
        .failure("missing_table");
    assert!(line.contains("inbox_events"), "{line}");
    let line = outboxctl(&bare, &["dead-letters", "list"])
        .await
        .failure("missing_table");
    assert!(line.contains("inbox_dead_letters"), "{line}");
    let line = outboxctl(&bare, &["dead-letters", "purge", "--older-than", "30d"])
        .await
        .failure("missing_table");
    assert!(line.contains("inbox_dead_letters"), "{line}");
}

/// `inbox owners` and `inbox set-owner`, as the tables' owner: a name claimed
/// before its consumer starts, one the runtime's role registered handed over
/// (that role then sees none of it), the refusals; under a consumer's role
/// (row-level security applies) `status` warns and `owners` refuses.
#[tokio::test]
async fn consumer_names_are_claimed_beforehand_and_handed_over() {
    let db = TestDb::new().await.unwrap();
    let tag = &db.name()[db.name().len() - 8..];
    for _ in 0..2 {
        execute(&db, include_str!("../../../ops/sql/roles.sql")).await;
    }
    let (x, y) = (format!("octl_x_{tag}"), format!("octl_y_{tag}"));
    execute(
        &db,
        &format!(
            "create role {x} login; grant outbox_consumer to {x};
             create role {y} login; grant outbox_consumer to {y};"
        ),
    )
    .await;
    let url = db.url();
    let as_x = url.replacen("postgres://postgres@", &format!("postgres://{x}@"), 1);

    // Claimed before its consumer first starts.
    let claimed = outboxctl(
        url,
        &["inbox", "set-owner", "early", &y, "--stream", "OUTBOX"],
    )
    .await
    .json();
    assert_eq!(
        claimed,
        json!({"consumer": "early", "owner": y, "previous_owner": null, "registered": true})
    );
    // Registered by the runtime's role (its insert at start), then handed over.
    let x_pool = sqlx::PgPool::connect(&as_x).await.unwrap();
    sqlx::query("insert into inbox_consumers (consumer, stream) values ('late', 'OUTBOX')")
        .execute(&x_pool)
        .await
        .unwrap();
    let owners = outboxctl(url, &["inbox", "owners"]).await.json();
    let listed: Vec<(String, String)> = owners["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["consumer"].as_str().unwrap().to_owned(),
                c["owner"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("early".to_owned(), y.clone()),
            ("late".to_owned(), x.clone())
        ],
        "{owners}"
    );
    let handed = outboxctl(url, &["inbox", "set-owner", "late", &y])
        .await
        .json();
    assert_eq!(handed["previous_owner"], x.as_str(), "{handed}");
    assert_eq!(handed["registered"], false, "{handed}");
    let seen: i64 = sqlx::query_scalar("select count(*) from inbox_consumers")
        .fetch_one(&x_pool)
        .await
        .unwrap();
    assert_eq!(seen, 0, "the previous owner sees none of it");
    let text = outboxctl_text(url, &["inbox", "owners", "--consumer", "late"]).await;
    assert!(
        text.stdout.contains(&y) && text.stdout.contains("OUTBOX"),
        "{}",
        text.stdout
    );

    // Refused: a name not registered without --stream, a role that does not
    // exist, a role every consumer's role is a member of.
    let line = outboxctl(url, &["inbox", "set-owner", "nobody", &y])
        .await
        .failure("not_found");
    assert!(
        line.contains("not registered") && line.contains("--stream"),
        "{line}"
    );
    let line = outboxctl(url, &["inbox", "set-owner", "late", "no_such_role"])
        .await
        .failure("not_found");
    assert!(
        line.contains("role `no_such_role` does not exist"),
        "{line}"
    );
    let line = outboxctl(url, &["inbox", "set-owner", "late", "outbox_consumer"])
        .await
        .failure("config");
    assert!(line.contains("every consumer's role"), "{line}");
    assert_eq!(
        count(
            &db.pool,
            &format!("select count(*) from inbox_consumers where owner = '{y}'")
        )
        .await,
        2,
        "nothing changed by the refusals"
    );

    // Under a consumer's role: what it sees is its own only, and said so.
    let status = outboxctl(&as_x, &["inbox", "status"]).await;
    assert_eq!(status.code, Some(0), "{}", status.stderr);
    assert!(
        status
            .stderr
            .contains(&format!("role `{x}` is subject to the row-level security")),
        "{}",
        status.stderr
    );
    let line = outboxctl(&as_x, &["inbox", "owners"])
        .await
        .failure("config");
    assert!(
        line.contains(&format!("role `{x}`")) && line.contains("tables' owner"),
        "{line}"
    );

    x_pool.close().await;
    execute(
        &db,
        &format!("drop owned by {x}, {y}; drop role {x}; drop role {y}"),
    )
    .await;
}
