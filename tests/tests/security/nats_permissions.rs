//! NATS least privilege: the configuration of docs/security.md ("NATS"),
//! taken from the document as it is, run by a real nats-server, and the
//! shipped binaries each under its user and inbox prefix.
//!
//! - `outbox-relay` publishes events written as plain SQL rows; `billing
//!   --consumer billing` and `billing --consumer shipping` (`--no-relay`,
//!   ordered) handle each; the relay's audit and `outboxctl audit` read the
//!   stream back; a poison message is dead-lettered by both consumers and
//!   `outboxctl dead-letters replay` publishes it again for one; billing,
//!   killed with `kill -9` and started again, leads again, and a leader
//!   that dies with deliveries unacked is taken over with a scan of the
//!   stream. No component is refused anything.
//! - Connected as shipping's user, a client can neither pull from billing's
//!   durable, ack for it, delete it, nor listen on billing's inbox (while the
//!   same subscription by a user allowed billing's inbox sees billing's
//!   deliveries).
//! - A binary whose user lacks one permission names the subject in its log
//!   within seconds: at start-up it stops with an error naming it (the relay
//!   without `STREAM.INFO`, billing without its inbox); afterwards it logs it
//!   at error level and goes on (billing without `CONSUMER.MSG.NEXT`, the
//!   relay without an event subject).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::{Event, ServerError};
use futures::StreamExt;
use outbox_testkit::{NatsServer, Program, TestDb, create_database, wait_until};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use super::support;

/// Bound on every wait for a condition.
const WAIT: Duration = Duration::from_secs(30);

/// The users of the documented configuration.
const USERS: [&str; 4] = ["relay", "billing", "shipping", "outboxctl"];

/// What a permissions violation of the server says.
const VIOLATION: &str = "Permissions Violation";

/// The `nats-server.conf` block of docs/security.md's "NATS" section.
fn documented_config() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/security.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let (_, section) = doc
        .split_once("\n## NATS\n")
        .expect("docs/security.md has a section \"NATS\"");
    let (_, block) = section
        .split_once("```text\n")
        .expect("the NATS section holds a ```text block");
    let (config, _) = block.split_once("\n```").unwrap();
    config.to_owned()
}

fn password(user: &str) -> String {
    format!("{user}-nats-s3cret")
}

/// `config` with each `$<USER>_PASSWORD` (read from the server's environment
/// in production) written in, and without its JetStream store directory: the
/// harness gives the server its own (`-sd`, which nats-server refuses beside
/// a `store_dir` of the file).
fn with_passwords(config: &str) -> String {
    let store_dir = config
        .lines()
        .find(|line| line.trim_start().starts_with("store_dir:"))
        .expect("the config sets JetStream's store_dir");
    let mut config = config.replace(&format!("{store_dir}\n"), "");
    for user in USERS {
        let variable = format!("${}_PASSWORD", user.to_uppercase());
        assert!(config.contains(&variable), "{variable} in the config");
        config = config.replace(&variable, &format!("{:?}", password(user)));
    }
    config
}

/// `config` with `from` replaced by `to` (both whole lines' worth of text)
/// in the block of `user` only; `to` empty drops the line.
fn change_for(config: &str, user: &str, from: &str, to: &str) -> String {
    let start = config
        .find(&format!("user: {user}\n"))
        .unwrap_or_else(|| panic!("no user {user}"));
    let end = config[start + 1..]
        .find("user: ")
        .map_or(config.len(), |at| start + 1 + at);
    let block = &config[start..end];
    let at = block
        .find(from)
        .unwrap_or_else(|| panic!("{from} not in {user}'s permissions"));
    let changed = if to.is_empty() {
        let line_start = block[..at].rfind('\n').map_or(0, |n| n + 1);
        let line_end = block[at..].find('\n').map_or(block.len(), |n| at + n + 1);
        format!("{}{}", &block[..line_start], &block[line_end..])
    } else {
        block.replacen(from, to, 1)
    };
    format!("{}{changed}{}", &config[..start], &config[end..])
}

fn nats_server(config: &str) -> NatsServer {
    support::blocking(|| NatsServer::start_with_config(config)).unwrap()
}

/// One run: nats-server with `config` (passwords written in), the outbox
/// database, and a log directory.
struct World {
    nats: NatsServer,
    db: TestDb,
    logs: tempfile::TempDir,
}

impl World {
    async fn new(config: &str) -> Self {
        let nats = nats_server(&with_passwords(config));
        let db = TestDb::new().await.unwrap();
        let logs = tempfile::Builder::new()
            .prefix("outbox-nats-permissions-")
            .tempdir()
            .unwrap();
        Self { nats, db, logs }
    }

    /// The environment that makes a binary connect as `user`, with its own
    /// inbox prefix.
    fn as_user(&self, user: &str) -> Vec<(String, String)> {
        vec![
            ("NATS_URL".into(), self.nats.url()),
            ("NATS_USER".into(), user.into()),
            ("NATS_PASSWORD".into(), password(user)),
            ("NATS_INBOX_PREFIX".into(), format!("_INBOX_{user}")),
        ]
    }

    fn program(&self, bin: &str, name: &str, env: &[(String, String)]) -> Program {
        let mut program = Program::new(name, support::bin_dir().join(bin), self.logs.path());
        for (key, value) in env {
            program = program.env(key, value.clone());
        }
        program
    }

    /// `outbox-relay` as the relay's user: a 5 s duplicate window, so the
    /// audit reads rows back 6.25 s after they are published.
    fn relay(&self, name: &str, metrics: std::net::SocketAddr) -> Program {
        let mut env = self.as_user("relay");
        env.push(("DATABASE_URL".into(), self.db.url().to_owned()));
        self.program("outbox-relay", name, &env).args([
            "--stream",
            "OUTBOX",
            "--subjects",
            "subscription.>,invoice.>",
            "--poll-interval",
            "50ms",
            "--publish-timeout",
            "1s",
            "--lease",
            "3s",
            "--duplicate-window",
            "5s",
            "--audit-interval",
            "500ms",
            "--metrics-addr",
            &metrics.to_string(),
        ])
    }

    /// `billing --consumer <user>` as that user, on `database_url`, only
    /// consuming (`--no-relay`).
    fn billing(&self, name: &str, user: &str, database_url: &str, extra: &[&str]) -> Program {
        let mut env = self.as_user(user);
        env.push(("DATABASE_URL".into(), database_url.to_owned()));
        self.program("billing", name, &env)
            .args(["--consumer", user, "--stream", "OUTBOX", "--no-relay"])
            .args(extra.iter().copied())
            .ready_when("billing ready")
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.logs.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Waits until `name`'s log holds `text`, failing with the log.
    async fn wait_logged(&self, name: &str, text: &str) {
        if wait_until(&format!("{name} to log `{text}`"), WAIT, || async {
            self.log(name).contains(text)
        })
        .await
        .is_err()
        {
            panic!("{name} logged no `{text}` in {WAIT:?}:\n{}", self.log(name));
        }
    }

    /// `n` `subscription.created` events, as a plain SQL writer adds them.
    async fn write(&self, from: usize, n: usize) {
        let rows: Vec<_> = (from..from + n)
            .map(|i| {
                let id = format!("sub_{i}");
                let data = json!({
                    "subscription_id": id, "customer_id": "cus_1", "plan": "pro", "amount_cents": 1200,
                });
                (Uuid::now_v7(), id, data)
            })
            .collect();
        support::insert_events(&self.db.pool, "subscription.created", &rows).await;
    }

    async fn unpublished(&self) -> i64 {
        support::count_where(&self.db.pool, "published_at is null").await
    }
}

/// A consumer's own database.
struct Side {
    url: String,
    pool: PgPool,
}

impl Side {
    async fn new(w: &World, user: &str) -> Self {
        let url = create_database(w.db.url(), &format!("{}_{user}", w.db.name()))
            .await
            .unwrap();
        let pool = PgPool::connect(&url).await.unwrap();
        Self { url, pool }
    }

    async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.pool)
            .await
            .unwrap_or(0)
    }

    /// Waits until the consumer has made `n` invoices.
    async fn wait_invoices(&self, w: &World, consumer: &str, n: i64) {
        let done = wait_until(&format!("{consumer}'s {n} invoices"), WAIT, || async {
            self.count("select count(*) from invoices").await == n
        })
        .await;
        if done.is_err() {
            let logs: Vec<String> = std::fs::read_dir(w.logs.path())
                .unwrap()
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with(consumer))
                .map(|e| support::log_tail(&e.path()))
                .collect();
            panic!(
                "{consumer} has {} invoices, not {n}:\n{}",
                self.count("select count(*) from invoices").await,
                logs.join("\n---\n")
            );
        }
    }
}

/// The server errors a plain client was told of.
type Told = Arc<Mutex<Vec<String>>>;

/// A plain client connected as `user` with inbox prefix `prefix`; what the
/// server tells it goes to the returned list.
async fn client_as(url: &str, user: &str, prefix: &str) -> (async_nats::Client, Told) {
    let told: Told = Arc::default();
    let sink = Arc::clone(&told);
    let client = async_nats::ConnectOptions::new()
        .user_and_password(user.into(), password(user))
        .custom_inbox_prefix(prefix)
        .request_timeout(Some(Duration::from_secs(2)))
        .event_callback(move |event| {
            let sink = Arc::clone(&sink);
            async move {
                if let Event::ServerError(ServerError::Other(text)) = event {
                    sink.lock().unwrap().push(text);
                }
            }
        })
        .connect(url)
        .await
        .unwrap();
    (client, told)
}

/// Waits until the server has told the client of a permissions violation for
/// `what` (`Publish to "…"`, `Subscription to "…"`).
async fn wait_told(told: &Told, what: &str) {
    let expected = format!("{VIOLATION} for {what}");
    if wait_until(&expected, WAIT, || async {
        told.lock().unwrap().iter().any(|t| t == &expected)
    })
    .await
    .is_err()
    {
        panic!("not told `{expected}`: {:?}", told.lock().unwrap());
    }
}

/// Panics if any log of the run holds a permissions violation.
fn assert_nothing_refused(w: &World) {
    for entry in std::fs::read_dir(w.logs.path()).unwrap() {
        let path: PathBuf = entry.unwrap().path();
        let log = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            !log.contains(VIOLATION),
            "{} was refused something:\n{log}",
            path.display()
        );
    }
}

async fn metric(addr: std::net::SocketAddr, name: &str) -> f64 {
    let Some((_, body)) = support::http::get(addr, "/metrics", Duration::from_secs(5)).await else {
        return 0.0;
    };
    body.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// `outboxctl <args>` as the outboxctl user, on the outbox database; its exit
/// code, stdout and stderr.
async fn outboxctl(w: &World, database_url: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let run = tokio::process::Command::new(support::bin_dir().join("outboxctl"))
        .envs(w.as_user("outboxctl"))
        .env("DATABASE_URL", database_url)
        .env_remove("DATABASE_URL_FILE")
        .args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("outboxctl finished within 60 s")
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_component_works_under_its_documented_nats_user_and_no_more() {
    let started = Instant::now();
    let w = World::new(&documented_config()).await;
    let (billing_db, shipping_db) = (
        Side::new(&w, "billing").await,
        Side::new(&w, "shipping").await,
    );

    // The relay creates the stream and publishes; both consumers handle
    // every event.
    let metrics = support::http::free_addr();
    let mut relay = w.relay("relay", metrics);
    relay.start().await.unwrap();
    w.write(0, 5).await;
    let mut billing = w.billing("billing-1", "billing", &billing_db.url, &[]);
    let mut shipping = w.billing("shipping", "shipping", &shipping_db.url, &[]);
    billing.start().await.unwrap();
    shipping.start().await.unwrap();
    billing_db.wait_invoices(&w, "billing", 5).await;
    shipping_db.wait_invoices(&w, "shipping", 5).await;
    assert_eq!(w.unpublished().await, 0);

    // Poison on an event subject, from a client allowed to publish there:
    // each consumer dead-letters it.
    let (relay_client, _) = client_as(&w.nats.url(), "relay", "_INBOX_relay").await;
    let js = async_nats::jetstream::new(relay_client);
    js.publish("subscription.created", "not json".into())
        .await
        .unwrap()
        .await
        .unwrap();
    for (side, consumer) in [(&billing_db, "billing"), (&shipping_db, "shipping")] {
        wait_until(&format!("{consumer}'s dead letter"), WAIT, || async {
            side.count("select count(*) from inbox_dead_letters").await == 1
        })
        .await
        .unwrap();
    }

    // The relay's audit reads every row back (a dense page: through its
    // range consumer), 6.25 s after it was published.
    wait_until("the relay's audit to check the rows", WAIT, || async {
        metric(metrics, "outbox_relay_audit_checked_total").await >= 5.0
    })
    .await
    .unwrap();
    assert!(
        !w.log("relay").contains("audit pass failed"),
        "{}",
        w.log("relay")
    );
    // So does outboxctl's.
    let (code, stdout, stderr) = outboxctl(&w, w.db.url(), &["audit", "--since", "1h"]).await;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("checked 5, intact 5,"),
        "{stdout}\n{stderr}"
    );

    // outboxctl replays billing's dead letter: billing dead-letters it again
    // (it is still poison), shipping acks it unhandled.
    let id: i64 = sqlx::query_scalar("select id from inbox_dead_letters")
        .fetch_one(&billing_db.pool)
        .await
        .unwrap();
    let (code, stdout, stderr) = outboxctl(
        &w,
        &billing_db.url,
        &["dead-letters", "replay", &id.to_string()],
    )
    .await;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    wait_until("billing's second dead letter", WAIT, || async {
        billing_db
            .count("select count(*) from inbox_dead_letters")
            .await
            == 2
    })
    .await
    .unwrap();

    // kill -9: billing started again leads again and handles new events;
    // this one dies after committing its first batch, before the acks.
    billing.kill9().await;
    let mut crashing = w.billing(
        "billing-2",
        "billing",
        &billing_db.url,
        &["--crash-after-commit", "1"],
    );
    crashing.start().await.unwrap();
    w.write(5, 3).await;
    assert_eq!(crashing.wait_exit(WAIT).await, None, "aborted");
    assert!(
        w.log("billing-2").contains("injected crash"),
        "{}",
        w.log("billing-2")
    );
    assert!(
        billing_db.count("select count(*) from invoices").await > 5,
        "billing-2 committed before it died"
    );
    // The next leader scans the stream from the ack floor for what it left
    // (the checkpoint forgotten: the whole range, through its reader).
    sqlx::query("update inbox_leases set checkpoint_seq = null, checkpoint_pending = '{}'")
        .execute(&billing_db.pool)
        .await
        .unwrap();
    let mut billing = w.billing("billing-3", "billing", &billing_db.url, &[]);
    billing.start().await.unwrap();
    w.wait_logged("billing-3", "taking over").await;
    let takeover = w.log("billing-3");
    assert!(!takeover.contains("scanned=0"), "{takeover}");
    w.write(8, 2).await;
    billing_db.wait_invoices(&w, "billing", 10).await;
    shipping_db.wait_invoices(&w, "shipping", 10).await;
    let epoch: i64 =
        sqlx::query_scalar("select epoch from inbox_leases where consumer = 'billing'")
            .fetch_one(&billing_db.pool)
            .await
            .unwrap();
    assert_eq!(epoch, 3, "three leaders in turn");
    assert_eq!(
        shipping_db
            .count("select count(*) from inbox_dead_letters")
            .await,
        1,
        "the replay was billing's"
    );
    assert_nothing_refused(&w);
    let working = started.elapsed();

    // Shipping's user may not touch billing's durable.
    let (spy, told) = client_as(&w.nats.url(), "shipping", "_INBOX_shipping").await;
    let shipping_js = async_nats::jetstream::new(spy.clone());
    let stream = shipping_js.get_stream("OUTBOX").await.unwrap();
    stream.consumer_info("shipping").await.unwrap();
    let pull = spy
        .request(
            "$JS.API.CONSUMER.MSG.NEXT.OUTBOX.billing",
            r#"{"batch":10,"expires":1000000000}"#.into(),
        )
        .await;
    assert!(pull.is_err(), "no answer to a refused pull: {pull:?}");
    wait_told(
        &told,
        r#"Publish to "$JS.API.CONSUMER.MSG.NEXT.OUTBOX.billing""#,
    )
    .await;
    spy.publish("$JS.ACK.OUTBOX.billing.1.10.10.0.0", "+ACK".into())
        .await
        .unwrap();
    spy.flush().await.unwrap();
    wait_told(&told, r#"Publish to "$JS.ACK.OUTBOX.billing.1.10.10.0.0""#).await;
    let delete = spy
        .request("$JS.API.CONSUMER.DELETE.OUTBOX.billing", "".into())
        .await;
    assert!(delete.is_err(), "{delete:?}");
    wait_told(
        &told,
        r#"Publish to "$JS.API.CONSUMER.DELETE.OUTBOX.billing""#,
    )
    .await;
    let (billing_client, _) = client_as(&w.nats.url(), "billing", "_INBOX_billing").await;
    let durable = async_nats::jetstream::new(billing_client.clone())
        .get_stream("OUTBOX")
        .await
        .unwrap()
        .consumer_info("billing")
        .await
        .unwrap()
        .clone();
    assert_eq!(durable.name, "billing", "billing's durable is still there");

    // Nor listen on billing's inbox, where billing's pulled messages arrive;
    // a user allowed that inbox sees them.
    let mut overheard = spy.subscribe("_INBOX_billing.>").await.unwrap();
    wait_told(&told, r#"Subscription to "_INBOX_billing.>""#).await;
    let mut allowed = billing_client.subscribe("_INBOX_billing.>").await.unwrap();
    billing_client.flush().await.unwrap();
    w.write(10, 2).await;
    billing_db.wait_invoices(&w, "billing", 12).await;
    let delivery = async {
        // A pulled message: its reply subject is billing's ack subject.
        while let Some(message) = allowed.next().await {
            let reply = message.reply.as_deref().unwrap_or_default();
            if reply.starts_with("$JS.ACK.OUTBOX.billing.") {
                return;
            }
        }
    };
    tokio::time::timeout(WAIT, delivery)
        .await
        .expect("a user allowed billing's inbox sees billing's deliveries");
    // Whatever the server routed to the spy before this round trip has
    // reached its subscription by now: nothing.
    spy.flush().await.unwrap();
    assert!(
        futures::FutureExt::now_or_never(overheard.next()).is_none(),
        "shipping's user heard a message on billing's inbox"
    );
    assert_nothing_refused(&w);

    relay.terminate().await;
    billing.terminate().await;
    shipping.terminate().await;
    eprintln!(
        "working under the documented permissions: {working:?}; in all {:?}",
        started.elapsed()
    );
}

/// A run on the documented configuration less `line` in `user`'s
/// permissions (or with it replaced by `with`).
async fn missing(user: &str, line: &str, with: &str) -> World {
    World::new(&change_for(&documented_config(), user, line, with)).await
}

/// Waits until `program` has exited with status 1, failing with its log
/// if it runs on; returns its log.
async fn wait_failed(w: &World, program: &mut Program) -> String {
    let code = program.wait_exit(WAIT).await;
    let log = w.log(&program.name);
    assert_eq!(
        code,
        Some(1),
        "{} did not stop with an error:\n{log}",
        program.name
    );
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_may_not_read_the_stream_stops_at_start_naming_the_subject() {
    let w = missing("relay", r#""$JS.API.STREAM.INFO.OUTBOX""#, "").await;
    let mut relay = w.relay("relay", support::http::free_addr());
    let started = Instant::now();
    relay.start().await.unwrap();
    let log = wait_failed(&w, &mut relay).await;
    assert!(
        log.contains(r#"Permissions Violation for Publish to "$JS.API.STREAM.INFO.OUTBOX""#),
        "{log}"
    );
    assert!(log.contains("outbox-relay failed"), "{log}");
    assert!(
        log.contains("allow `$JS.API.STREAM.INFO.OUTBOX` in the user's `publish` permissions"),
        "{log}"
    );
    eprintln!("stopped after {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_may_not_publish_an_event_type_names_the_subject_and_goes_on() {
    let w = missing("relay", r#""subscription.>""#, "").await;
    let mut relay = w.relay("relay", support::http::free_addr());
    relay.start().await.unwrap();
    w.write(0, 1).await;
    let started = Instant::now();
    w.wait_logged(
        "relay",
        r#"Permissions Violation for Publish to "subscription.created""#,
    )
    .await;
    eprintln!("named after {:?}", started.elapsed());
    assert!(w.log("relay").contains("ERROR"), "{}", w.log("relay"));
    assert!(!relay.died(), "the relay goes on: {}", w.log("relay"));
    assert_eq!(w.unpublished().await, 1, "the row waits");
    relay.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_may_not_pull_names_the_subject() {
    let w = missing(
        "billing",
        r#""$JS.API.CONSUMER.MSG.NEXT.OUTBOX.billing""#,
        "",
    )
    .await;
    let mut relay = w.relay("relay", support::http::free_addr());
    relay.start().await.unwrap();
    let side = Side::new(&w, "billing").await;
    let mut billing = w.billing("billing", "billing", &side.url, &[]);
    billing.start().await.unwrap();
    let started = Instant::now();
    w.wait_logged(
        "billing",
        r#"Permissions Violation for Publish to "$JS.API.CONSUMER.MSG.NEXT.OUTBOX.billing""#,
    )
    .await;
    eprintln!("named after {:?}", started.elapsed());
    let log = w.log("billing");
    assert!(log.contains("ERROR"), "{log}");
    assert!(log.contains("in the user's `publish` permissions"), "{log}");
    billing.terminate().await;
    relay.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_may_not_read_its_inbox_stops_at_start_naming_it() {
    // The usual `_INBOX.>`, while billing's replies come on `_INBOX_billing`.
    let w = missing("billing", r#""_INBOX_billing.>""#, r#""_INBOX.>""#).await;
    let mut relay = w.relay("relay", support::http::free_addr());
    relay.start().await.unwrap();
    let side = Side::new(&w, "billing").await;
    let mut billing = w.billing("billing", "billing", &side.url, &[]);
    let started = Instant::now();
    // It stops before it is ready.
    assert!(billing.start().await.is_err(), "{}", w.log("billing"));
    let log = wait_failed(&w, &mut billing).await;
    assert!(
        log.contains(r#"Permissions Violation for Subscription to "_INBOX_billing."#),
        "{log}"
    );
    assert!(log.contains("`_INBOX_billing.>`"), "{log}");
    assert!(log.contains("--nats-inbox-prefix"), "{log}");
    eprintln!("stopped after {:?}", started.elapsed());
    relay.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outboxctl_command_refused_a_read_ends_naming_the_subject() {
    let w = missing("outboxctl", r#""$JS.API.STREAM.INFO.OUTBOX""#, "").await;
    let started = Instant::now();
    let (code, stdout, stderr) = outboxctl(&w, w.db.url(), &["audit", "--since", "1h"]).await;
    assert_ne!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(r#"Permissions Violation for Publish to "$JS.API.STREAM.INFO.OUTBOX""#),
        "{stderr}"
    );
    // At once, not after its 10 s timeout.
    let took = started.elapsed();
    assert!(took < Duration::from_secs(8), "{took:?}");
    eprintln!("ended after {took:?}");
}

#[test]
fn a_line_is_changed_in_one_users_permissions_only() {
    let config = documented_config();
    let without = change_for(&config, "relay", r#""subscription.>""#, "");
    assert_eq!(
        without.matches(r#""subscription.>""#).count(),
        config.matches(r#""subscription.>""#).count() - 1
    );
    let relay = without.find("user: relay").unwrap();
    let billing = without.find("user: billing").unwrap();
    assert!(!without[relay..billing].contains("\"subscription.>\""));
}
