//! Production connections, each against a real server set up in the test:
//! the shipped `outbox-relay` (and `billing`) binaries reach PostgreSQL over
//! TLS only and NATS with a token, an nkey, a creds file (decentralised JWT
//! auth), server-verified TLS and mutual TLS, with every secret given through
//! the environment or a `--*-file` flag, never argv.
//!
//! - Each auth method publishes an event written to `outbox_events` into the
//!   stream; `billing` consumes it over mutual TLS to both servers.
//! - Wrong credentials end the binary with an error that says so, in bounded
//!   time.
//! - PostgreSQL refuses a plain connection; `sslmode=verify-full` with the
//!   test CA works and with another CA fails, naming the certificate.
//! - No secret is in `/proc/<pid>/cmdline` or in the binary's log.
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use outbox_pg::{Envelope, Outbox};
use outbox_publisher::cli::NatsArgs;
use outbox_testkit::{
    CLIENT_NAME, JwtAuth, NatsServer, NkeyUser, PgServer, TestCerts, TestDb, create_database,
    token_config,
};
use serde_json::json;
use tokio::process::{Child, Command};

/// Bound on every wait: a start-up, a publish, an exit.
const WAIT: Duration = Duration::from_secs(30);

/// The password written into the database URLs the binaries get. The TLS
/// server trusts every role over TLS, so it is never asked for; it is there to
/// show the URL's secret reaches neither argv nor the logs.
const PG_PASSWORD: &str = "pg-url-s3cret";

/// A child process (`outbox-relay`, `billing`) with a clean environment
/// holding only what the test gives it, its stdout and stderr in one log file.
struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(bin: &str, dir: &Path, name: &str, env: &[(&str, &str)], args: &[&str]) -> Self {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(super::support::bin_dir().join(bin))
            .env_clear()
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .args(args)
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
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The command line as `ps` shows it to every user of the machine.
    fn cmdline(&self) -> String {
        let pid = self.child.id().expect("running");
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|raw| String::from_utf8_lossy(&raw).replace('\0', " "))
            .unwrap()
    }

    /// Panics with the log if the process has exited.
    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("{} exited ({status}):\n{}", self.name, self.log());
        }
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

    /// Waits (bounded) for a line of the log containing `marker`, failing
    /// early if the process exits.
    async fn wait_for_line(&mut self, marker: &str) {
        let deadline = Instant::now() + WAIT;
        while !self.log().contains(marker) {
            self.assert_running();
            assert!(
                Instant::now() < deadline,
                "{} printed no `{marker}` within {WAIT:?}:\n{}",
                self.name,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A PostgreSQL server that accepts TLS only, a migrated database on it, the
/// certificates, and a directory for secret files and logs.
struct Secure {
    certs: TestCerts,
    pg: PgServer,
    db: TestDb,
    dir: tempfile::TempDir,
}

async fn secure() -> Secure {
    let (certs, pg) = tokio::task::spawn_blocking(|| {
        let certs = TestCerts::generate().unwrap();
        let pg = PgServer::start_tls(&certs).unwrap();
        (certs, pg)
    })
    .await
    .unwrap();
    let db = TestDb::on(&pg).await.unwrap();
    let dir = tempfile::Builder::new()
        .prefix("outbox-secure-")
        .tempdir()
        .unwrap();
    Secure { certs, pg, db, dir }
}

impl Secure {
    /// The database's URL with [`PG_PASSWORD`] in it: `sslmode=verify-full`
    /// against the test CA.
    fn db_url(&self) -> String {
        with_password(self.db.url(), PG_PASSWORD)
    }

    /// Writes `contents` to a file of the test directory (mode 0600), with a
    /// trailing newline as `echo` leaves one.
    fn secret_file(&self, name: &str, contents: &str) -> String {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.path().join(name);
        std::fs::write(&path, format!("{contents}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path.display().to_string()
    }

    fn relay(&self, name: &str, env: &[(&str, &str)], args: &[&str]) -> Proc {
        Proc::spawn(
            "outbox-relay",
            self.dir.path(),
            name,
            env,
            &[
                &["--poll-interval", "50ms", "--publish-timeout", "2s"][..],
                args,
            ]
            .concat(),
        )
    }

    /// Writes `n` events in one transaction.
    async fn seed(&self, event_type: &str, n: usize) {
        let events: Vec<_> = (0..n)
            .map(|i| {
                Envelope::new(
                    event_type,
                    "secure-tests",
                    format!("sub_{i}"),
                    json!({"subscription_id": format!("sub_{i}"), "customer_id": "cus_1", "amount_cents": 1200}),
                )
                .unwrap()
            })
            .collect();
        let mut tx = self.db.pool.begin().await.unwrap();
        Outbox::unvalidated()
            .enqueue_all(&mut tx, &events)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    async fn unpublished(&self) -> i64 {
        sqlx::query_scalar("select count(*) from outbox_events where published_at is null")
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// Waits until every row is published (its PubAck received), failing
    /// early with the relay's log if it exits.
    async fn wait_published(&self, relay: &mut Proc) {
        let deadline = Instant::now() + WAIT;
        while self.unpublished().await > 0 {
            relay.assert_running();
            assert!(
                Instant::now() < deadline,
                "rows still unpublished after {WAIT:?}:\n{}",
                relay.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `url` (`postgres://user@…`) with `password` added to its user info.
fn with_password(url: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (user, host) = rest.split_once('@').unwrap();
    format!("{scheme}://{user}:{password}@{host}")
}

/// `url` logging in as `user` instead.
fn with_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (_, host) = rest.split_once('@').unwrap();
    format!("{scheme}://{user}@{host}")
}

fn refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// Messages in `stream`, read with a client connected as `nats` says.
async fn stream_messages(nats: &NatsArgs, stream: &str) -> u64 {
    let client = nats.connect("secure-tests").await.unwrap();
    let js = async_nats::jetstream::new(client);
    js.get_stream(stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages
}

/// Neither the command line nor the log of `process` holds any of `secrets`.
fn assert_no_secrets(process: &Proc, cmdline: &str, secrets: &[&str]) {
    let log = process.log();
    for secret in secrets {
        assert!(
            !cmdline.contains(secret),
            "secret in /proc/<pid>/cmdline: {cmdline}"
        );
        assert!(
            !log.contains(secret),
            "secret in {}'s log:\n{log}",
            process.name
        );
    }
}

fn nats_server(config: &str) -> NatsServer {
    tokio::task::block_in_place(|| NatsServer::start_with_config(config)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_and_the_database_url_from_files_publish_and_never_reach_argv_or_logs() {
    let s = secure().await;
    let token = "nats-tok-s3cret";
    let nats = nats_server(&token_config(token));
    s.seed("orders.created", 5).await;
    let token_file = s.secret_file("nats-token", token);
    let url_file = s.secret_file("database-url", &s.db_url());

    let mut relay = s.relay(
        "relay",
        &[("NATS_URL", &nats.url()), ("DATABASE_URL_FILE", &url_file)],
        &[
            "--nats-token-file",
            &token_file,
            "--stream",
            "SECURE_TOKEN",
            "--subjects",
            "orders.>",
        ],
    );
    let cmdline = relay.cmdline();
    s.wait_published(&mut relay).await;

    let mut reader = NatsArgs::new(nats.url());
    reader.nats_token = Some(token.into());
    assert_eq!(stream_messages(&reader, "SECURE_TOKEN").await, 5);
    assert_no_secrets(&relay, &cmdline, &[token, PG_PASSWORD]);
    // The database is named in the start-up log, its password masked.
    assert!(
        relay.log().contains("postgres:***@127.0.0.1"),
        "{}",
        relay.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nkey_seed_file_publishes() {
    let s = secure().await;
    let user = NkeyUser::generate().unwrap();
    let nats = nats_server(&user.server_config());
    s.seed("orders.created", 3).await;
    let seed_file = s.secret_file("nats-seed", user.seed());
    let db_url = s.db_url();

    let mut relay = s.relay(
        "relay",
        &[("NATS_URL", &nats.url()), ("DATABASE_URL", &db_url)],
        &[
            "--nats-nkey-file",
            &seed_file,
            "--stream",
            "SECURE_NKEY",
            "--subjects",
            "orders.>",
        ],
    );
    let cmdline = relay.cmdline();
    s.wait_published(&mut relay).await;

    let mut reader = NatsArgs::new(nats.url());
    reader.nats_nkey = Some(user.seed().into());
    assert_eq!(stream_messages(&reader, "SECURE_NKEY").await, 3);
    assert_no_secrets(&relay, &cmdline, &[user.seed(), PG_PASSWORD]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creds_file_with_operator_signed_jwts_publishes() {
    let s = secure().await;
    let auth = JwtAuth::generate("relay").unwrap();
    let nats = nats_server(&auth.server_config());
    s.seed("orders.created", 4).await;
    let creds = s.secret_file("relay.creds", &auth.creds());
    let db_url = s.db_url();

    let mut relay = s.relay(
        "relay",
        &[
            ("NATS_URL", &nats.url()),
            ("NATS_CREDS", &creds),
            ("DATABASE_URL", &db_url),
        ],
        &["--stream", "SECURE_JWT", "--subjects", "orders.>"],
    );
    let cmdline = relay.cmdline();
    s.wait_published(&mut relay).await;

    let mut reader = NatsArgs::new(nats.url());
    reader.nats_creds = Some(creds.into());
    assert_eq!(stream_messages(&reader, "SECURE_JWT").await, 4);
    assert_no_secrets(&relay, &cmdline, &[auth.user_seed(), PG_PASSWORD]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_verified_tls_to_nats_publishes() {
    let s = secure().await;
    let nats = nats_server(&s.certs.nats_tls_block(false));
    s.seed("orders.created", 2).await;
    let ca = s.certs.ca().display().to_string();
    let db_url = s.db_url();

    let mut relay = s.relay(
        "relay",
        &[
            ("NATS_URL", &nats.url()),
            ("NATS_TLS_CA", &ca),
            ("DATABASE_URL", &db_url),
        ],
        &["--stream", "SECURE_TLS", "--subjects", "orders.>"],
    );
    s.wait_published(&mut relay).await;

    let mut reader = NatsArgs::new(nats.url());
    reader.nats_tls_ca = Some(s.certs.ca());
    assert_eq!(stream_messages(&reader, "SECURE_TLS").await, 2);

    // A client that does not trust the server's CA is refused at start.
    let mut untrusting = s.relay(
        "untrusting",
        &[
            ("NATS_URL", &nats.url()),
            ("NATS_TLS_CA", &s.certs.other_ca().display().to_string()),
            ("DATABASE_URL", &db_url),
        ],
        &["--stream", "SECURE_TLS", "--subjects", "orders.>"],
    );
    assert!(!untrusting.exit().await.success());
    assert!(
        untrusting.log().contains("TLS with NATS"),
        "{}",
        untrusting.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_carries_events_from_the_relay_to_billing() {
    let s = secure().await;
    let nats = nats_server(&s.certs.nats_tls_block(true));
    // The client certificate's common name logs in (pg_hba `cert`).
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "create role {CLIENT_NAME} login superuser"
    )))
    .execute(&s.db.pool)
    .await
    .unwrap();
    let client_tls = format!(
        "&sslcert={}&sslkey={}",
        s.certs.client_cert().display(),
        s.certs.client_key().display()
    );
    let relay_url = format!("{}{client_tls}", with_user(s.db.url(), CLIENT_NAME));
    let billing_db = format!("{}_billing", s.db.name());
    let billing_url = format!(
        "{}{client_tls}",
        with_user(
            &create_database(s.db.url(), &billing_db).await.unwrap(),
            CLIENT_NAME
        )
    );
    s.seed("subscription.created", 1).await;
    let ca = s.certs.ca().display().to_string();
    let cert = s.certs.client_cert().display().to_string();
    let key = s.certs.client_key().display().to_string();
    let nats_tls = [
        ("NATS_URL", nats.url()),
        ("NATS_TLS_CA", ca.clone()),
        ("NATS_TLS_CERT", cert),
        ("NATS_TLS_KEY", key),
    ];
    let env = |url: &str| -> Vec<(String, String)> {
        nats_tls
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .chain([("DATABASE_URL".to_owned(), url.to_owned())])
            .collect()
    };
    let relay_env = env(&relay_url);
    let mut relay = s.relay(
        "relay",
        &refs(&relay_env),
        &[
            "--stream",
            "SECURE_MTLS",
            "--subjects",
            "subscription.>,invoice.>",
        ],
    );
    s.wait_published(&mut relay).await;

    let billing_env = env(&billing_url);
    let mut billing = Proc::spawn(
        "billing",
        s.dir.path(),
        "billing",
        &refs(&billing_env),
        &["--stream", "SECURE_MTLS", "--consumer", "billing"],
    );
    billing.wait_for_line("billing ready").await;
    let billing_pool = sqlx::PgPool::connect(&s.pg.url(&billing_db)).await.unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        let invoices: i64 =
            sqlx::query_scalar("select count(*) from invoices where subscription_id = 'sub_0'")
                .fetch_one(&billing_pool)
                .await
                .unwrap_or(0);
        if invoices == 1 {
            break;
        }
        billing.assert_running();
        assert!(
            Instant::now() < deadline,
            "no invoice after {WAIT:?}:\n{}",
            billing.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Without a client certificate, the broker refuses the handshake.
    let mut anonymous = s.relay(
        "anonymous",
        &[
            ("NATS_URL", &nats.url()),
            ("NATS_TLS_CA", &ca),
            ("DATABASE_URL", &s.db_url()),
        ],
        &["--stream", "SECURE_MTLS"],
    );
    let status = anonymous.exit().await;
    assert!(!status.success(), "{}", anonymous.log());
    assert!(
        anonymous.log().contains("TLS with NATS"),
        "{}",
        anonymous.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_or_nkey_ends_the_relay_with_an_auth_error() {
    let s = secure().await;
    let db_url = s.db_url();

    let token_nats = nats_server(&token_config("the-right-token"));
    let mut relay = s.relay(
        "wrong-token",
        &[
            ("NATS_URL", &token_nats.url()),
            ("NATS_TOKEN", "a-wrong-token"),
            ("DATABASE_URL", &db_url),
        ],
        &["--stream", "SECURE_WRONG"],
    );
    let status = relay.exit().await;
    assert!(!status.success());
    let log = relay.log();
    assert!(log.contains("refused the credentials"), "{log}");
    assert!(log.contains("authorization violation"), "{log}");
    assert!(!log.contains("a-wrong-token"), "{log}");

    let user = NkeyUser::generate().unwrap();
    let nkey_nats = nats_server(&user.server_config());
    let stranger = NkeyUser::generate().unwrap();
    let seed_file = s.secret_file("stranger-seed", stranger.seed());
    let mut relay = s.relay(
        "wrong-nkey",
        &[
            ("NATS_URL", &nkey_nats.url()),
            ("NATS_NKEY_FILE", &seed_file),
            ("DATABASE_URL", &db_url),
        ],
        &["--stream", "SECURE_WRONG"],
    );
    let status = relay.exit().await;
    assert!(!status.success());
    let log = relay.log();
    assert!(log.contains("refused the credentials"), "{log}");
    assert!(!log.contains(stranger.seed()), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_plain_connections_and_verify_full_needs_the_right_ca() {
    let s = secure().await;
    let nats = nats_server("");
    let base = s.db.url().split('?').next().unwrap().to_owned();

    // The server refuses a connection without TLS (pg_hba `hostnossl … reject`).
    let plain = sqlx::PgPool::connect(&format!("{base}?sslmode=disable"))
        .await
        .unwrap_err();
    let plain = plain.to_string();
    assert!(
        plain.contains("no encryption") || plain.contains("pg_hba"),
        "{plain}"
    );

    // verify-full against the test CA works.
    let verified = sqlx::PgPool::connect(s.db.url()).await.unwrap();
    let ssl: bool = sqlx::query_scalar("select ssl from pg_stat_ssl where pid = pg_backend_pid()")
        .fetch_one(&verified)
        .await
        .unwrap();
    assert!(ssl);

    // The relay with sslmode=disable is refused by the server and exits.
    let mut relay = s.relay(
        "plain",
        &[
            ("NATS_URL", &nats.url()),
            (
                "DATABASE_URL",
                &with_password(&format!("{base}?sslmode=disable"), PG_PASSWORD),
            ),
        ],
        &["--once"],
    );
    assert!(!relay.exit().await.success());
    let log = relay.log();
    assert!(log.contains("connecting to the database at"), "{log}");
    assert!(!log.contains(PG_PASSWORD), "{log}");

    // verify-full with a CA that did not sign the server's certificate fails.
    let wrong_ca = with_password(
        &format!(
            "{base}?sslmode=verify-full&sslrootcert={}",
            s.certs.other_ca().display()
        ),
        PG_PASSWORD,
    );
    let mut relay = s.relay(
        "wrong-ca",
        &[("NATS_URL", &nats.url()), ("DATABASE_URL", &wrong_ca)],
        &["--once"],
    );
    assert!(!relay.exit().await.success());
    let log = relay.log();
    assert!(log.to_lowercase().contains("certificate"), "{log}");
    assert!(!log.contains(PG_PASSWORD), "{log}");

    // And verify-full with the test CA: the relay drains and exits 0.
    s.seed("orders.created", 1).await;
    let mut relay = s.relay(
        "verified",
        &[("NATS_URL", &nats.url()), ("DATABASE_URL", &s.db_url())],
        &["--once", "--stream", "SECURE_PG", "--subjects", "orders.>"],
    );
    assert!(relay.exit().await.success(), "{}", relay.log());
    assert_eq!(s.unpublished().await, 0);
}

#[tokio::test]
async fn inline_secrets_exclude_their_files_and_unreadable_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = |env: &[(&str, &str)], args: &[&str]| {
        let mut p = Proc::spawn("outbox-relay", dir.path(), "relay", env, args);
        async move {
            let status = p.exit().await;
            (status, p.log())
        }
    };

    // NATS_TOKEN from the environment and --nats-token-file: clap refuses.
    let (status, log) = run(
        &[
            ("DATABASE_URL", "postgres://127.0.0.1:1/none"),
            ("NATS_TOKEN", "t"),
        ],
        &["--nats-token-file", "/etc/hostname"],
    )
    .await;
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains("cannot be used with"), "{log}");

    let (status, log) = run(
        &[
            ("DATABASE_URL", "postgres://127.0.0.1:1/none"),
            ("DATABASE_URL_FILE", "/etc/hostname"),
        ],
        &[],
    )
    .await;
    assert_eq!(status.code(), Some(2), "{log}");

    // A file that cannot be read: one error naming the flag and the path.
    let (status, log) = run(
        &[("DATABASE_URL_FILE", "/nonexistent/database-url")],
        &["--once"],
    )
    .await;
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("--database-url-file"), "{log}");
    assert!(log.contains("/nonexistent/database-url"), "{log}");
}
