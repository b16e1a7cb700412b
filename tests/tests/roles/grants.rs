//! Least privilege, end to end: the real binaries run under login roles that
//! hold only the group roles of `ops/sql/roles.sql` (and their service's own
//! tables, granted as an operator would), never as the owner.
//!
//! - A database migrated by its owner (the library's migrations, billing's
//!   and subscriptions' tables), `ops/sql/roles.sql` applied twice.
//! - `subscriptions` under a writer (`outbox_writer` + its table), started
//!   `--no-relay`: its in-process relay would run under the writer's role,
//!   which must not update or delete outbox rows. Its events are published by
//!   `outbox-relay` under a relay role (`outbox_relay` only). `billing` under
//!   a role with `outbox_consumer` and `outbox_writer` (it enqueues
//!   `invoice.created` in its handler's transaction) + `invoices`, also
//!   `--no-relay`: the same `outbox-relay` publishes its events (one
//!   database for both services here).
//! - Events driven through subscriptions' HTTP API; effects asserted from the
//!   database: invoices raised and voided, inbox rows, every outbox row
//!   published. Each start-up `migrate` ran under a non-owner on an
//!   up-to-date schema and said so in one line.
//! - A relay run in-process (billing's, subscriptions') under a role without
//!   `outbox_relay` stops its service, naming what it lacks.
//! - Only what the configuration uses is required: DELETE on `outbox_events`
//!   only with retention on, `inbox_leases` only for an ordered consumer.
//! - In a second database, one right taken from each group role: each binary
//!   exits non-zero with an error naming the role, the privilege and the table.
//! - A privilege revoked while billing runs is logged as an error on every
//!   attempt and never dead-lettered; granted again, the event is handled.
//! - `outbox_pg::migrate_with` under a non-owner: an up-to-date schema
//!   leaves the service's SQL to the owner; a pending migration is a `Privilege` error saying to migrate as
//!   the owner. Each group role holds exactly its grants.
//! - In a schema reached through `search_path`, roles.sql grants there.
//! - Consumers kept apart from each other by row-level security:
//!   `isolation.rs`.
//!
//! The binaries are built by `scripts/test` (`cargo build --workspace --bins`)
//! before the tests run.

use std::path::{Path, PathBuf};
use std::time::Duration;

use outbox_testkit::{NatsServer, Program, TestDb, create_database, wait_until};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ROLES_SQL: &str = include_str!("../../../ops/sql/roles.sql");

/// The stream's subjects: subscriptions' events and billing's.
const SUBJECTS: &str = "subscription.>,invoice.>";

/// Login roles of one test run (roles are cluster-wide: named per run).
struct Logins {
    writer: String,
    relay: String,
    billing: String,
}

impl Logins {
    fn new(tag: &str) -> Self {
        Self {
            writer: format!("writer_{tag}"),
            relay: format!("relay_{tag}"),
            billing: format!("billing_{tag}"),
        }
    }
}

/// `url` with `user` instead of the owner (the test server trusts loopback).
pub(super) fn as_user(url: &str, user: &str) -> String {
    url.replacen("postgres://postgres@", &format!("postgres://{user}@"), 1)
}

/// The owner's steps on a fresh database: the migrations (done by
/// [`TestDb`]), the services' own tables, `ops/sql/roles.sql` twice, and the
/// operator's grants of the services' tables to their login roles.
/// The login roles are created on the first database (they are
/// cluster-wide), once the group roles exist.
async fn prepare(owner: &PgPool, logins: &Logins, first: bool) {
    example_billing::migrate(owner).await.unwrap();
    example_subscriptions::migrate(owner).await.unwrap();
    for _ in 0..2 {
        sqlx::raw_sql(sqlx::AssertSqlSafe(ROLES_SQL))
            .execute(owner)
            .await
            .unwrap();
    }
    if first {
        create_logins(owner, logins).await;
    }
    let grants = format!(
        "grant select, insert, update on subscriptions to {w};
         grant select, insert, update on invoices to {b};
         grant select, insert on trial_ends to {b};",
        w = logins.writer,
        b = logins.billing,
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(grants))
        .execute(owner)
        .await
        .unwrap();
}

/// Creates the login roles, members of the group roles (cluster-wide: once).
async fn create_logins(owner: &PgPool, logins: &Logins) {
    let sql = format!(
        "create role {w} login; grant outbox_writer to {w};
         create role {r} login; grant outbox_relay to {r};
         create role {b} login; grant outbox_consumer, outbox_writer to {b};",
        w = logins.writer,
        r = logins.relay,
        b = logins.billing,
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(owner)
        .await
        .unwrap();
}

async fn drop_logins(owner: &PgPool, logins: &Logins, databases: &[&PgPool]) {
    for pool in databases {
        let sql = format!(
            "drop owned by {}, {}, {}",
            logins.writer, logins.relay, logins.billing
        );
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(*pool).await;
    }
    let sql = format!(
        "drop role if exists {}, {}, {}",
        logins.writer, logins.relay, logins.billing
    );
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(owner).await;
}

pub(super) fn log_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join("outbox-roles").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub(super) fn log_of(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

/// `subscriptions --no-relay` on a free loopback port, its logs in `dir`,
/// connected as `database_url` says; the process and its address.
pub(super) async fn start_subscriptions(dir: &Path, database_url: &str) -> (Program, String) {
    let mut subscriptions = Program::new(
        "subscriptions",
        super::support::bin_dir().join("subscriptions"),
        dir,
    )
    .env("DATABASE_URL", database_url)
    .args(["--listen", "127.0.0.1:0", "--no-relay"])
    .ready_when("listening on");
    let line = subscriptions
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", log_of(dir, "subscriptions")))
        .unwrap();
    let addr = line
        .trim()
        .trim_start_matches("listening on http://")
        .to_owned();
    (subscriptions, addr)
}

/// One HTTP/1.1 request to `addr`; returns the status and the JSON body.
pub(super) async fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, serde_json::Value) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let text = String::from_utf8_lossy(&response);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let json = text
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(serde_json::Value::Null);
    (status, json)
}

pub(super) async fn count(pool: &PgPool, sql: &str, bind: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(bind)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Runs `bin` with `args` under `url` to its end (bounded); returns the exit
/// code and what it printed.
async fn run_to_exit(bin: &str, url: &str, nats: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(super::support::bin_dir().join(bin))
            .args(args)
            .env("DATABASE_URL", url)
            .env("NATS_URL", nats)
            .env("RUST_LOG", "info")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{bin} did not exit within 60 s"))
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[tokio::test]
async fn the_binaries_run_under_least_privilege_roles_and_a_missing_right_is_named() {
    let nats = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    let db = TestDb::new().await.unwrap();
    let tag = db.name().trim_start_matches("outbox_test_")[20..].to_owned();
    let logins = Logins::new(&tag);
    prepare(&db.pool, &logins, true).await;
    let dir = log_dir(db.name());

    // --- Everything under its own role.
    let mut relay = Program::new(
        "relay",
        super::support::bin_dir().join("outbox-relay"),
        &dir,
    )
    .env("DATABASE_URL", as_user(db.url(), &logins.relay))
    .env("NATS_URL", nats.url())
    .args(["--poll-interval", "100ms", "--subjects", SUBJECTS]);
    relay.start().await.unwrap();
    let (mut subscriptions, addr) =
        start_subscriptions(&dir, &as_user(db.url(), &logins.writer)).await;
    let mut billing = Program::new("billing", super::support::bin_dir().join("billing"), &dir)
        .env("DATABASE_URL", as_user(db.url(), &logins.billing))
        .env("NATS_URL", nats.url())
        .args(["--no-relay", "--concurrency", "2", "--ack-wait", "5s"])
        .ready_when("billing ready");
    billing
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&dir, "billing")));

    // Start-up migrations under non-owners on an up-to-date schema: one INFO
    // line leaving the service's SQL to the owner, no warning.
    for (name, user) in [
        ("subscriptions", &logins.writer),
        ("billing", &logins.billing),
    ] {
        let log = log_of(&dir, name);
        assert!(
            log.contains("the service's schema SQL left to the owner")
                && log.contains(user.as_str()),
            "{name}: no line naming {user}:\n{log}"
        );
        assert!(!log.contains("ERROR"), "{name}:\n{log}");
    }

    let mut ids = Vec::new();
    for customer in ["cust_a", "cust_b", "cust_c"] {
        let body = format!(r#"{{"customer_id":"{customer}","plan":"pro","amount_cents":1200}}"#);
        let (status, json) = http(&addr, "POST", "/v1/subscriptions", &body).await;
        assert_eq!(status, 201, "{json}\n{}", log_of(&dir, "subscriptions"));
        ids.push(json["id"].as_str().unwrap().to_owned());
    }
    let (status, json) = http(
        &addr,
        "POST",
        &format!("/v1/subscriptions/{}/cancel", ids[0]),
        "",
    )
    .await;
    assert!((200..300).contains(&status), "{status} {json}");
    let pool = &db.pool;
    wait_until(
        "every invoice raised and the cancelled one voided",
        Duration::from_secs(60),
        || async {
            let mut done = true;
            for id in &ids {
                done &= count(
                    pool,
                    "select count(*) from invoices where subscription_id = $1",
                    id,
                )
                .await
                    == 1;
            }
            done && count(
            pool,
            "select count(*) from invoices where subscription_id = $1 and voided_at is not null",
            &ids[0],
        )
        .await
            == 1
        },
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}\n--- relay:\n{}\n--- billing:\n{}",
            log_of(&dir, "relay"),
            log_of(&dir, "billing")
        )
    });
    // Four events handled through the inbox; every event published, billing's
    // own invoice.created included.
    assert_eq!(
        count(
            pool,
            "select count(*) from inbox_events where consumer = $1",
            "billing"
        )
        .await,
        4
    );
    wait_until("every outbox row published", Duration::from_secs(30), || async {
        count(pool, "select count(*) from outbox_events where published_at is null and event_type like $1", "%").await == 0
            && count(pool, "select count(*) from outbox_events where event_type = $1", "invoice.created").await == 3
    })
    .await
    .unwrap();
    assert_eq!(
        count(
            pool,
            "select count(*) from inbox_dead_letters where consumer = $1",
            "billing"
        )
        .await,
        0
    );

    // A trial schedules its end, and converting cancels it: the writer's
    // role schedules and cancels.
    let body = r#"{"customer_id":"cust_t","plan":"pro","amount_cents":1200,"trial":true}"#;
    let (status, json) = http(&addr, "POST", "/v1/subscriptions", body).await;
    assert_eq!(status, 201, "{json}\n{}", log_of(&dir, "subscriptions"));
    let trial = json["id"].as_str().unwrap().to_owned();
    let (status, json) = http(
        &addr,
        "POST",
        &format!("/v1/subscriptions/{trial}/convert"),
        "",
    )
    .await;
    assert_eq!(status, 200, "{json}\n{}", log_of(&dir, "subscriptions"));
    assert_eq!(
        count(
            &db.pool,
            "select count(*) from outbox_events where cancelled_at is not null
               and cancelled_by = $1",
            &logins.writer,
        )
        .await,
        1
    );

    // --- A right revoked at run time: loud, retried, never dead-lettered.
    sqlx::query("revoke insert on inbox_events from outbox_consumer")
        .execute(pool)
        .await
        .unwrap();
    let body = r#"{"customer_id":"cust_d","plan":"pro","amount_cents":1200}"#;
    let (status, json) = http(&addr, "POST", "/v1/subscriptions", body).await;
    assert_eq!(status, 201, "{json}");
    let late = json["id"].as_str().unwrap().to_owned();
    wait_until(
        "billing reports the refused insert",
        Duration::from_secs(30),
        || async {
            let log = log_of(&dir, "billing");
            log.contains("lacks a privilege")
                && log.contains("permission denied for table inbox_events")
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&dir, "billing")));
    sqlx::query("grant insert on inbox_events to outbox_consumer")
        .execute(pool)
        .await
        .unwrap();
    wait_until(
        "the refused event handled once granted",
        Duration::from_secs(60),
        || async {
            count(
                pool,
                "select count(*) from invoices where subscription_id = $1",
                &late,
            )
            .await
                == 1
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&dir, "billing")));
    assert_eq!(
        count(
            pool,
            "select count(*) from inbox_dead_letters where consumer = $1",
            "billing"
        )
        .await,
        0
    );

    // Retention ran at start (inbox, dead letters, published rows) with the
    // roles' grants alone.
    for name in ["billing", "relay"] {
        let log = log_of(&dir, name);
        assert!(!log.contains("pruning failed"), "{name}:\n{log}");
        assert!(
            !log.contains("pruning published outbox rows failed"),
            "{name}:\n{log}"
        );
    }
    for p in [&mut billing, &mut subscriptions, &mut relay] {
        let code = p.terminate().await;
        assert_eq!(
            code,
            Some(0),
            "{} did not stop cleanly:\n{}",
            p.name,
            log_of(&dir, &p.name)
        );
    }

    // --- Only what the configuration uses is required: without DELETE on
    // outbox_events a relay without retention runs, one with it is refused;
    // without inbox_leases an unordered billing runs, an ordered one is refused.
    sqlx::raw_sql(
        "revoke delete on outbox_events from outbox_relay;
         revoke all on inbox_leases from outbox_consumer;",
    )
    .execute(pool)
    .await
    .unwrap();
    let relay_url = as_user(db.url(), &logins.relay);
    let (code, out) = run_to_exit(
        "outbox-relay",
        &relay_url,
        &nats.url(),
        &["--once", "--retention", "0", "--subjects", SUBJECTS],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let (code, out) = run_to_exit(
        "outbox-relay",
        &relay_url,
        &nats.url(),
        &["--once", "--subjects", SUBJECTS],
    )
    .await;
    assert!(code.is_some_and(|c| c != 0), "{code:?}\n{out}");
    assert!(out.contains("lacks DELETE on table outbox_events"), "{out}");
    let mut unordered = Program::new(
        "billing-unordered",
        super::support::bin_dir().join("billing"),
        &dir,
    )
    .env("DATABASE_URL", as_user(db.url(), &logins.billing))
    .env("NATS_URL", nats.url())
    .args(["--no-relay", "--unordered"])
    .ready_when("billing ready");
    unordered
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&dir, "billing-unordered")));
    assert_eq!(
        unordered.terminate().await,
        Some(0),
        "{}",
        log_of(&dir, "billing-unordered")
    );
    let (code, out) = run_to_exit(
        "billing",
        &as_user(db.url(), &logins.billing),
        &nats.url(),
        &["--no-relay"],
    )
    .await;
    assert!(code.is_some_and(|c| c != 0), "{code:?}\n{out}");
    assert!(
        out.contains("lacks SELECT on table inbox_leases, INSERT on table inbox_leases, UPDATE on table inbox_leases"),
        "{out}"
    );

    // --- A relay run in-process under a role without outbox_relay stops its
    // service with the missing rights named (hence --no-relay above).
    for (bin, user, args) in [
        ("billing", &logins.billing, vec!["--unordered"]),
        (
            "subscriptions",
            &logins.writer,
            vec!["--listen", "127.0.0.1:0"],
        ),
    ] {
        let (code, out) = run_to_exit(bin, &as_user(db.url(), user), &nats.url(), &args).await;
        assert!(code.is_some_and(|c| c != 0), "{bin}: {code:?}\n{out}");
        assert!(
            out.contains(&format!(
                "role `{user}` lacks SELECT on table outbox_events"
            )) && out.contains("grant it outbox_relay"),
            "{bin}:\n{out}"
        );
    }

    // --- One right taken from each group role, in a database of its own.
    let other_name = format!("{}_revoked", db.name());
    let other_url = create_database(db.url(), &other_name).await.unwrap();
    let other = PgPool::connect(&other_url).await.unwrap();
    outbox_pg::migrate(&other).await.unwrap();
    prepare(&other, &logins, false).await;
    sqlx::raw_sql(
        "revoke update on outbox_events from outbox_relay;
         revoke insert on inbox_events from outbox_consumer;
         revoke insert on outbox_events from outbox_writer;",
    )
    .execute(&other)
    .await
    .unwrap();
    let cases = [
        (
            "outbox-relay",
            &logins.relay,
            vec!["--poll-interval", "100ms", "--subjects", SUBJECTS],
            "lacks UPDATE on table outbox_events",
        ),
        (
            "billing",
            &logins.billing,
            vec!["--no-relay"],
            "lacks INSERT on table inbox_events",
        ),
        (
            "subscriptions",
            &logins.writer,
            vec!["--listen", "127.0.0.1:0", "--no-relay"],
            "lacks INSERT on table outbox_events",
        ),
    ];
    for (bin, user, args, expected) in cases {
        let (code, out) = run_to_exit(bin, &as_user(&other_url, user), &nats.url(), &args).await;
        assert!(
            code.is_some_and(|c| c != 0),
            "{bin} exited {code:?}:\n{out}"
        );
        let line = out
            .lines()
            .find(|l| l.contains(expected))
            .unwrap_or_else(|| panic!("{bin}: no line with `{expected}`:\n{out}"));
        assert!(
            line.contains(&format!("role `{user}`")) && line.contains("ops/sql/roles.sql"),
            "{bin}: {line}"
        );
    }

    drop_logins(&db.pool, &logins, &[&db.pool, &other]).await;
    other.close().await;
}

#[tokio::test]
async fn migrate_under_a_non_owner_warns_on_an_up_to_date_schema_and_refuses_a_pending_one() {
    let db = TestDb::new().await.unwrap();
    let tag = db.name().trim_start_matches("outbox_test_")[20..].to_owned();
    let logins = Logins::new(&format!("m{tag}"));
    prepare(&db.pool, &logins, true).await;
    // Each group role holds exactly its grants: every table privilege of
    // every role on the library's tables, and none may create in the schema.
    let held: Vec<(String, String, String)> = sqlx::query_as(
        "select r, t, p
           from unnest(array['outbox_writer', 'outbox_relay', 'outbox_consumer']) r,
                unnest(array['outbox_events', 'inbox_events', 'inbox_dead_letters',
                             'inbox_leases', 'inbox_consumers', 'outbox_schema_migrations',
                             'outbox_relay_slots']) t,
                unnest(array['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE',
                             'REFERENCES', 'TRIGGER']) p
          where has_table_privilege(r, t, p)
          order by 1, 2, 3",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let held: Vec<String> = held
        .into_iter()
        .map(|(r, t, p)| format!("{r} {p} {t}"))
        .collect();
    let mut expected: Vec<String> = [
        "outbox_consumer DELETE inbox_dead_letters",
        "outbox_consumer INSERT inbox_dead_letters",
        "outbox_consumer SELECT inbox_dead_letters",
        "outbox_consumer INSERT inbox_consumers",
        "outbox_consumer SELECT inbox_consumers",
        "outbox_consumer DELETE inbox_events",
        "outbox_consumer INSERT inbox_events",
        "outbox_consumer SELECT inbox_events",
        "outbox_consumer INSERT inbox_leases",
        "outbox_consumer SELECT inbox_leases",
        "outbox_consumer UPDATE inbox_leases",
        "outbox_consumer SELECT outbox_schema_migrations",
        "outbox_relay DELETE outbox_events",
        "outbox_relay DELETE outbox_relay_slots",
        "outbox_relay INSERT outbox_relay_slots",
        "outbox_relay SELECT outbox_relay_slots",
        "outbox_relay UPDATE outbox_relay_slots",
        "outbox_relay SELECT outbox_events",
        "outbox_relay UPDATE outbox_events",
        "outbox_relay SELECT outbox_schema_migrations",
        "outbox_writer INSERT outbox_events",
        "outbox_writer SELECT outbox_schema_migrations",
    ]
    .map(String::from)
    .to_vec();
    expected.sort();
    let mut sorted = held.clone();
    sorted.sort();
    assert_eq!(sorted, expected);
    // inbox_consumers: UPDATE of where a consumer stands, never of its name
    // or owner (row-level security keeps consumers apart by the owner).
    let updatable: Vec<String> = sqlx::query_scalar(
        "select a.attname::text from pg_attribute a
          where a.attrelid = 'inbox_consumers'::regclass and a.attnum > 0 and not a.attisdropped
            and has_column_privilege('outbox_consumer', a.attrelid, a.attnum, 'UPDATE')
          order by 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        updatable,
        [
            "ack_floor",
            "filter_subjects",
            "stopped_at",
            "stream",
            "updated_at"
        ]
    );
    let may_read_owner: bool = sqlx::query_scalar(
        "select has_function_privilege('outbox_consumer', 'inbox_consumer_owner(text)', 'EXECUTE')
            and not has_function_privilege('outbox_relay', 'inbox_consumer_owner(text)', 'EXECUTE')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(may_read_owner);
    let creators: Vec<String> = sqlx::query_scalar(
        "select r from unnest(array['outbox_writer', 'outbox_relay', 'outbox_consumer']) r
          where has_schema_privilege(r, current_schema(), 'CREATE')
             or has_database_privilege(r, current_database(), 'CREATE')",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(creators.is_empty(), "{creators:?}");

    let as_relay = PgPool::connect(&as_user(db.url(), &logins.relay))
        .await
        .unwrap();

    // Up to date: nothing needing ownership runs; refused app DDL is no error.
    outbox_pg::migrate(&as_relay).await.unwrap();
    let report = outbox_pg::migrate_report(
        &as_relay,
        "create table if not exists invoices (id uuid primary key)",
    )
    .await
    .unwrap();
    assert!(report.applied.is_empty(), "{report}");
    assert!(
        matches!(&report.app_sql, outbox_pg::AppSql::LeftToOwner(why) if why.contains("permission denied")),
        "{report}"
    );
    // Any other failure of the app's SQL still is one.
    let err = outbox_pg::migrate_with(&as_relay, "select no_such_function()")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), outbox_pg::ErrorKind::Database, "{err}");

    // A pending migration: a clear error, nothing changed.
    let last = outbox_pg::MIGRATOR.iter().map(|m| m.version).max().unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "delete from {} where version = $1",
        outbox_pg::MIGRATION_TABLE
    )))
    .bind(last)
    .execute(&db.pool)
    .await
    .unwrap();
    let err = outbox_pg::migrate(&as_relay).await.unwrap_err();
    assert_eq!(err.kind(), outbox_pg::ErrorKind::Privilege, "{err}");
    let text = err.to_string();
    assert!(
        text.contains("not up to date")
            && text.contains(&last.to_string())
            && text.contains(&format!("role `{}`", logins.relay))
            && text.contains("as the schema owner"),
        "{text}"
    );
    // The owner applies it; the non-owner then starts cleanly again.
    outbox_pg::migrate(&db.pool).await.unwrap();
    outbox_pg::migrate(&as_relay).await.unwrap();

    // A role that may not even read the history is told so.
    let sql = format!("create role nobody_{tag} login");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&db.pool)
        .await
        .unwrap();
    let nobody = PgPool::connect(&as_user(db.url(), &format!("nobody_{tag}")))
        .await
        .unwrap();
    let err = outbox_pg::migrate(&nobody).await.unwrap_err();
    assert_eq!(err.kind(), outbox_pg::ErrorKind::Privilege, "{err}");
    assert!(
        err.to_string()
            .contains("lacks SELECT on table outbox_schema_migrations"),
        "{err}"
    );
    nobody.close().await;
    as_relay.close().await;
    let sql = format!("drop role nobody_{tag}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&db.pool)
        .await
        .unwrap();
    drop_logins(&db.pool, &logins, &[&db.pool]).await;
}

/// `ops/sql/roles.sql` grants on the objects of the first schema of the
/// search_path, and USAGE on that schema: a relay role reaching the tables
/// through `search_path` in its URL has what it needs there, and nothing in
/// `public`.
#[tokio::test]
async fn roles_sql_grants_in_the_schema_of_the_search_path() {
    let db = TestDb::new().await.unwrap();
    let tag = db.name().trim_start_matches("outbox_test_")[20..].to_owned();
    let schema = format!("tenant_{tag}");
    let sql = format!("create schema {schema}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&db.pool)
        .await
        .unwrap();
    let in_schema = |url: &str| format!("{url}?options=-csearch_path%3D{schema}");
    let owner = PgPool::connect(&in_schema(db.url())).await.unwrap();
    outbox_pg::migrate(&owner).await.unwrap();
    for _ in 0..2 {
        sqlx::raw_sql(sqlx::AssertSqlSafe(ROLES_SQL))
            .execute(&owner)
            .await
            .unwrap();
    }
    let relay = format!("relay_s{tag}");
    let sql = format!("create role {relay} login; grant outbox_relay to {relay}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&owner)
        .await
        .unwrap();

    let as_relay = PgPool::connect(&in_schema(&as_user(db.url(), &relay)))
        .await
        .unwrap();
    let required = outbox_publisher::required_privileges(&outbox_publisher::RelayConfig::default());
    outbox_pg::check_privileges(&as_relay, &required, "outbox_relay")
        .await
        .unwrap();
    outbox_pg::migrate(&as_relay).await.unwrap();
    let granted: bool = sqlx::query_scalar(
        "select has_table_privilege(to_regclass('outbox_events'), 'UPDATE')
            and has_schema_privilege(current_schema(), 'USAGE')
            and not has_table_privilege(to_regclass('public.outbox_events'), 'UPDATE')",
    )
    .fetch_one(&as_relay)
    .await
    .unwrap();
    assert!(granted);
    // Taken away in that schema: named.
    sqlx::query("revoke update on outbox_events from outbox_relay")
        .execute(&owner)
        .await
        .unwrap();
    let err = outbox_pg::check_privileges(&as_relay, &required, "outbox_relay")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), outbox_pg::ErrorKind::Privilege);
    assert!(
        err.to_string().contains(&format!(
            "role `{relay}` lacks UPDATE on table outbox_events"
        )),
        "{err}"
    );
    as_relay.close().await;
    let sql = format!("drop owned by {relay}; drop role {relay}");
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&owner)
        .await;
    owner.close().await;
}

/// A database whose schema came from the migration files alone (psql, a
/// service's own tool): no `outbox_schema_migrations`. roles.sql still
/// applies, twice, and grants the same rights on the tables.
#[tokio::test]
async fn roles_sql_applies_where_only_the_files_ran() {
    let server = TestDb::new().await.unwrap();
    let name = format!("{}_files", server.name());
    let url = create_database(server.url(), &name).await.unwrap();
    let owner = PgPool::connect(&url).await.unwrap();
    for migration in outbox_pg::MIGRATOR.iter() {
        sqlx::raw_sql(migration.sql.clone())
            .execute(&owner)
            .await
            .unwrap();
    }
    let history: Option<String> =
        sqlx::query_scalar("select to_regclass('outbox_schema_migrations')::text")
            .fetch_one(&owner)
            .await
            .unwrap();
    assert_eq!(history, None);
    for _ in 0..2 {
        sqlx::raw_sql(sqlx::AssertSqlSafe(ROLES_SQL))
            .execute(&owner)
            .await
            .unwrap();
    }
    let relay_may_update: bool = sqlx::query_scalar(
        "select has_table_privilege('outbox_relay', 'outbox_events', 'UPDATE')
            and has_table_privilege('outbox_writer', 'outbox_events', 'INSERT')
            and not has_table_privilege('outbox_writer', 'outbox_events', 'UPDATE')",
    )
    .fetch_one(&owner)
    .await
    .unwrap();
    assert!(relay_may_update);
    owner.close().await;
}
