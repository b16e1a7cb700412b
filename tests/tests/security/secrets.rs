//! Passwords that stay secret: a PostgreSQL login role and a NATS user whose
//! password holds every character that ends or splits a part of a URL
//! (`,` `#` `/` `?` `@` `%` `:`), given to every shipped binary that takes a
//! URL (`outbox-relay`, `billing`, `subscriptions`, `outboxctl`; `outbox-demo`
//! for the refusals, as its run with a valid URL is the whole demo) at
//! `RUST_LOG=debug`:
//!
//! - percent-encoded in the URL (through the flag, the environment variable
//!   and `--database-url-file`), the NATS one in the NATS URL or through
//!   `--nats-user`/`NATS_PASSWORD`: every binary connects, `/readyz` answers
//!   200 (NATS checked the password, so the URL's credentials reached it),
//!   and not one piece of the password, raw or encoded, is in the output,
//!   `/metrics`, `/readyz` or `/healthz`;
//! - a password with `,` `:` `%` `@` unencoded (legal where it is): the same;
//! - unencoded in the URL, where a `#`, `/` or `?` makes it ambiguous: every
//!   binary exits non-zero with an error naming the URL's problem, again
//!   without a piece of the password;
//! - a broker that cannot be reached: `/readyz` answers 503 naming the
//!   `broker` check in plain words, the `database` one passed.
//!
//! "A piece" is every substring of 4 characters or more, of the password and
//! of its percent-encoded form.
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use outbox_testkit::{NatsServer, TestDb};
use serde_json::Value;
use sqlx::postgres::PgConnectOptions;
use tokio::process::{Child, Command};

/// Every character a URL parser or a splitter could stop at.
const PASSWORD: &str = "Zq7,Wm3#xK9/pL?r2@Tn%5:Vb8";

/// A password that needs no encoding in a URL's user info, though `,` `:`
/// `%` `@` are in it (the comma is the one first reported logged in full).
const PLAIN_PASSWORD: &str = "Xr4,Hs8:Jd2%Qy6@Lw9";

const NATS_USER: &str = "natsuser";

/// Bound on every wait: a start, a readiness, an exit.
const WAIT: Duration = Duration::from_secs(30);

/// `s` percent-encoded: every byte but ASCII letters and digits.
fn encoded(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Every piece of 4 characters or more of `secret` and of its encoded form.
fn pieces(secret: &str) -> Vec<String> {
    let mut out = Vec::new();
    for form in [secret.to_owned(), encoded(secret)] {
        let chars: Vec<char> = form.chars().collect();
        for start in 0..chars.len() {
            for end in start + 4..=chars.len() {
                out.push(chars[start..end].iter().collect());
            }
        }
    }
    out
}

/// Panics naming the piece if `text` holds any piece of a password.
fn assert_clean(what: &str, text: &str) {
    for secret in [PASSWORD, PLAIN_PASSWORD] {
        for piece in pieces(secret) {
            assert!(
                !text.contains(&piece),
                "{what}: `{piece}` of a password in:\n{text}"
            );
        }
    }
}

/// The roles, databases and broker of one test.
struct World {
    dir: tempfile::TempDir,
    /// `host:port/` of the PostgreSQL server (and its query, if any).
    server: (String, u16, String),
    role: String,
    plain_role: String,
    nats: NatsServer,
}

impl World {
    async fn new() -> (Self, TestDb) {
        let db = TestDb::new().await.unwrap();
        let suffix = &db.name()[db.name().len() - 12..];
        let role = format!("relay_secret_{suffix}");
        let plain_role = format!("relay_plain_{suffix}");
        for (role, password) in [(&role, PASSWORD), (&plain_role, PLAIN_PASSWORD)] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "create role {role} login superuser password '{password}'"
            )))
            .execute(&db.pool)
            .await
            .unwrap();
        }
        let options = PgConnectOptions::from_str(db.url()).unwrap();
        let query = db
            .url()
            .split_once('?')
            .map(|(_, q)| format!("?{q}"))
            .unwrap_or_default();
        let config =
            format!("authorization {{\n  user: {NATS_USER:?}\n  password: {PASSWORD:?}\n}}\n");
        let nats = tokio::task::block_in_place(|| NatsServer::start_with_config(&config)).unwrap();
        let dir = tempfile::Builder::new()
            .prefix("outbox-secrets-")
            .tempdir()
            .unwrap();
        let world = Self {
            dir,
            server: (options.get_host().to_owned(), options.get_port(), query),
            role,
            plain_role,
            nats,
        };
        (world, db)
    }

    /// A URL of `database` logging in as `user` with `password` written as
    /// given (encoded or not).
    fn db_url(&self, user: &str, password: &str, database: &str) -> String {
        let (host, port, query) = &self.server;
        format!("postgres://{user}:{password}@{host}:{port}/{database}{query}")
    }

    /// The secret role's URL, its password percent-encoded.
    fn valid_url(&self, db: &TestDb) -> String {
        self.db_url(&self.role, &encoded(PASSWORD), db.name())
    }

    /// The secret role's URL, its password as it is: ambiguous.
    fn raw_url(&self, db: &TestDb) -> String {
        self.db_url(&self.role, PASSWORD, db.name())
    }

    /// The NATS URL with the user and `password` in it.
    fn nats_url(&self, password: &str) -> String {
        self.nats
            .url()
            .replacen("nats://", &format!("nats://{NATS_USER}:{password}@"), 1)
    }

    /// Writes `contents` to a file of the test directory.
    fn file(&self, name: &str, contents: &str) -> String {
        let path = self.dir.path().join(name);
        std::fs::write(&path, format!("{contents}\n")).unwrap();
        path.display().to_string()
    }

    fn spawn(&self, bin: &str, name: &str, env: &[(&str, &str)], args: &[&str]) -> Proc {
        Proc::spawn(self.dir.path(), bin, name, env, args)
    }
}

/// A binary run with a clean environment (`RUST_LOG=debug` and what the test
/// gives it), stdout and stderr in one log file.
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
    metrics: SocketAddr,
}

impl Proc {
    fn spawn(dir: &Path, bin: &str, name: &str, env: &[(&str, &str)], args: &[&str]) -> Self {
        let metrics = SocketAddr::from(([127, 0, 0, 1], outbox_testkit::free_port().unwrap()));
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let mut command = Command::new(super::support::bin_dir().join(bin));
        command
            .env_clear()
            .env("RUST_LOG", "debug")
            .envs(env.iter().copied())
            .args(args);
        if ["outbox-relay", "billing", "subscriptions"].contains(&bin) {
            command.args(["--metrics-addr", &metrics.to_string()]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self {
            name: name.to_owned(),
            child,
            log,
            metrics,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (bounded) for the process to exit on its own.
    async fn exit(&mut self) -> ExitStatus {
        match tokio::time::timeout(WAIT, self.child.wait()).await {
            Ok(status) => status.unwrap(),
            Err(_) => panic!(
                "{} still running after {WAIT:?}:\n{}",
                self.name,
                self.log()
            ),
        }
    }

    /// SIGTERM, then waits (bounded) for the exit.
    async fn stop(&mut self) {
        let pid = self.child.id().unwrap().to_string();
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .unwrap();
        self.exit().await;
    }

    /// Waits (bounded) until `GET path` answers `status`, failing early if
    /// the process exits; returns the body.
    async fn wait_for(&mut self, path: &str, status: u16) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let answer =
                super::support::http::get(self.metrics, path, Duration::from_secs(5)).await;
            if let Some((got, body)) = &answer
                && *got == status
            {
                return body.clone();
            }
            if let Some(exit) = self.child.try_wait().unwrap() {
                panic!("{} exited ({exit}):\n{}", self.name, self.log());
            }
            assert!(
                Instant::now() < deadline,
                "{}: {path} did not answer {status} within {WAIT:?} (last: {answer:?}):\n{}",
                self.name,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `/readyz` (once it answers `status`), `/metrics` and `/healthz`, each
    /// checked for pieces of the passwords; returns the `/readyz` body.
    async fn assert_endpoints_clean(&mut self, ready: u16) -> String {
        let readyz = self.wait_for("/readyz", ready).await;
        assert_clean(&format!("{} /readyz", self.name), &readyz);
        let metrics = self.wait_for("/metrics", 200).await;
        assert_clean(&format!("{} /metrics", self.name), &metrics);
        let healthz = self.wait_for("/healthz", 200).await;
        assert_clean(&format!("{} /healthz", self.name), &healthz);
        readyz
    }

    /// Stops the process and checks its output.
    async fn stop_clean(mut self) {
        self.stop().await;
        assert_clean(&format!("{}'s output", self.name), &self.log());
    }

    /// Waits for the process to exit with a failure naming `problem`, and
    /// checks its output.
    async fn refused(mut self, problem: &str) {
        let status = self.exit().await;
        let log = self.log();
        assert!(!status.success(), "{} exited 0:\n{log}", self.name);
        assert!(
            log.contains(problem),
            "{}: `{problem}` not named:\n{log}",
            self.name
        );
        assert_clean(&format!("{}'s output", self.name), &log);
    }
}

#[test]
fn pieces_cover_both_forms() {
    let all = pieces("ab,c#d");
    assert!(all.contains(&"ab,c".to_owned()));
    assert!(all.contains(&"%2Cc".to_owned()));
    assert!(!all.iter().any(|p| p.chars().count() < 4));
    assert_eq!(
        encoded(PASSWORD),
        "Zq7%2CWm3%23xK9%2FpL%3Fr2%40Tn%255%3AVb8"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valid_urls_connect_every_binary_and_show_no_piece_of_the_password() {
    let (w, relay_db) = World::new().await;
    let billing_db = TestDb::new().await.unwrap();
    let subs_db = TestDb::new().await.unwrap();
    let nats_url = w.nats_url(&encoded(PASSWORD));
    let relay_url = w.valid_url(&relay_db);
    let billing_url = w.valid_url(&billing_db);
    let subs_file = w.file("subscriptions-database-url", &w.valid_url(&subs_db));

    // The database URL through the flag, the environment and a file; the
    // NATS password in the URL (flag and environment) and through
    // --nats-user / NATS_PASSWORD.
    let mut relay = w.spawn(
        "outbox-relay",
        "relay",
        &[],
        &[
            "--database-url",
            &relay_url,
            "--nats-url",
            &nats_url,
            "--stream",
            "SECRETS_RELAY",
            "--subjects",
            "secrets.>",
            "--poll-interval",
            "50ms",
        ],
    );
    let mut billing = w.spawn(
        "billing",
        "billing",
        &[("DATABASE_URL", &billing_url), ("NATS_URL", &nats_url)],
        &["--stream", "SECRETS_BILLING"],
    );
    let mut subscriptions = w.spawn(
        "subscriptions",
        "subscriptions",
        &[
            ("DATABASE_URL_FILE", &subs_file),
            ("NATS_URL", &w.nats.url()),
            ("NATS_USER", NATS_USER),
            ("NATS_PASSWORD", PASSWORD),
        ],
        &[
            "--listen",
            "127.0.0.1:0",
            "--stream",
            "SECRETS_SUBS",
            "--subjects",
            "ssub.>",
        ],
    );
    relay.assert_endpoints_clean(200).await;
    billing.assert_endpoints_clean(200).await;
    subscriptions.assert_endpoints_clean(200).await;
    assert!(
        relay.log().contains(" DEBUG "),
        "no debug lines:\n{}",
        relay.log()
    );
    assert!(
        relay.log().contains(&format!("{}:***@", w.role)),
        "the relay does not name its database:\n{}",
        relay.log()
    );

    // outboxctl: the encoded URL, and one whose password needs no encoding.
    let ctl_file = w.file("outboxctl-database-url", &relay_url);
    let plain_url = w.db_url(&w.plain_role, PLAIN_PASSWORD, relay_db.name());
    let runs = [
        w.spawn(
            "outboxctl",
            "ctl-flag",
            &[],
            &["status", "--database-url", &relay_url],
        ),
        w.spawn(
            "outboxctl",
            "ctl-env",
            &[("DATABASE_URL", &relay_url)],
            &["status"],
        ),
        w.spawn(
            "outboxctl",
            "ctl-file",
            &[("DATABASE_URL_FILE", &ctl_file)],
            &["status"],
        ),
        w.spawn(
            "outboxctl",
            "ctl-plain",
            &[("DATABASE_URL", &plain_url)],
            &["status"],
        ),
        w.spawn(
            "outboxctl",
            "ctl-audit",
            &[("DATABASE_URL", &relay_url)],
            &[
                "audit",
                "--since",
                "1h",
                "--stream",
                "SECRETS_RELAY",
                "--nats-url",
                &nats_url,
            ],
        ),
    ];
    for mut ctl in runs {
        let status = ctl.exit().await;
        let log = ctl.log();
        assert!(status.success(), "{} failed:\n{log}", ctl.name);
        assert_clean(&format!("{}'s output", ctl.name), &log);
    }
    let mut plain = w.spawn(
        "outbox-relay",
        "relay-plain",
        &[("DATABASE_URL", &plain_url), ("NATS_URL", &nats_url)],
        &["--stream", "SECRETS_RELAY"],
    );
    plain.assert_endpoints_clean(200).await;

    relay.stop_clean().await;
    billing.stop_clean().await;
    subscriptions.stop_clean().await;
    plain.stop_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unencoded_password_is_refused_by_every_binary_without_a_piece_of_it() {
    let (w, db) = World::new().await;
    let raw = w.raw_url(&db);
    let file = w.file("raw-database-url", &raw);
    let valid = w.valid_url(&db);
    let raw_nats = w.nats_url(PASSWORD);
    let nats = w.nats_url(&encoded(PASSWORD));
    let mut runs = Vec::new();
    for bin in ["outbox-relay", "billing", "subscriptions", "outboxctl"] {
        // outboxctl needs a command; the services start with their flags.
        let command: &[&str] = if bin == "outboxctl" { &["status"] } else { &[] };
        let name = |how: &str| format!("{bin}-{how}");
        let env_nats = ("NATS_URL", nats.as_str());
        runs.push((
            w.spawn(
                bin,
                &name("flag"),
                &[env_nats],
                &[command, &["--database-url", &raw]].concat(),
            ),
            "database URL",
        ));
        runs.push((
            w.spawn(
                bin,
                &name("env"),
                &[("DATABASE_URL", &raw), env_nats],
                command,
            ),
            "database URL",
        ));
        runs.push((
            w.spawn(
                bin,
                &name("file"),
                &[("DATABASE_URL_FILE", &file), env_nats],
                command,
            ),
            "database URL",
        ));
    }
    // The NATS URL with the password unencoded, through the flag and the
    // environment; the database URL valid.
    runs.push((
        w.spawn(
            "outbox-relay",
            "relay-nats-flag",
            &[("DATABASE_URL", &valid)],
            &[
                "--nats-url",
                &raw_nats,
                "--stream",
                "SECRETS_RAW",
                "--subjects",
                "raw.>",
            ],
        ),
        "--nats-url",
    ));
    runs.push((
        w.spawn(
            "billing",
            "billing-nats-env",
            &[("DATABASE_URL", &valid), ("NATS_URL", &raw_nats)],
            &["--stream", "SECRETS_RAW_BILLING"],
        ),
        "--nats-url",
    ));
    runs.push((
        w.spawn(
            "outboxctl",
            "outboxctl-nats-flag",
            &[("DATABASE_URL", &valid)],
            &["audit", "--since", "1h", "--nats-url", &raw_nats],
        ),
        "--nats-url",
    ));
    // outbox-demo takes DATABASE_URL and NATS_URL from the environment.
    runs.push((
        w.spawn(
            "outbox-demo",
            "demo-database",
            &[("DATABASE_URL", &raw), ("NATS_URL", &nats)],
            &[],
        ),
        "database URL",
    ));
    runs.push((
        w.spawn(
            "outbox-demo",
            "demo-nats",
            &[("DATABASE_URL", &valid), ("NATS_URL", &raw_nats)],
            &[],
        ),
        "--nats-url",
    ));
    for (run, problem) in runs {
        run.refused(problem).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_the_failing_check_in_plain_words() {
    let (w, db) = World::new().await;
    // Credentials in the URL of a broker that is not there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nats = format!(
        "nats://{NATS_USER}:{}@127.0.0.1:{closed}",
        encoded(PASSWORD)
    );
    let mut relay = w.spawn(
        "outbox-relay",
        "relay-no-broker",
        &[("DATABASE_URL", &w.valid_url(&db)), ("NATS_URL", &nats)],
        &["--stream", "SECRETS_NO_BROKER", "--subjects", "nobroker.>"],
    );
    // 503 with the database checked: the relay has connected to it.
    let deadline = Instant::now() + WAIT;
    let report: Value = loop {
        let body = relay.assert_endpoints_clean(503).await;
        let report: Value = serde_json::from_str(&body).unwrap();
        if report["checks"]["database"]["ok"] == Value::Bool(true) {
            break report;
        }
        assert!(
            Instant::now() < deadline,
            "the database check never passed: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(report["ready"], Value::Bool(false), "{report}");
    assert_eq!(
        report["checks"]["broker"]["ok"],
        Value::Bool(false),
        "{report}"
    );
    let broker = report["checks"]["broker"]["error"].as_str().unwrap();
    assert!(broker.starts_with("not connected to NATS"), "{report}");
    relay.stop_clean().await;
}
