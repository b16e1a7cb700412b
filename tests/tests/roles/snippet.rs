//! docs/security.md's roles snippet, as written: its `sh` block (the three
//! steps: `outboxctl migrate` with each service's `--sql-dir`,
//! `ops/sql/roles.sql`, then `logins.sql` with the passwords as psql
//! variables) and its `sql` block (`logins.sql`) are taken from the page and
//! run verbatim by `bash` with the shipped `outboxctl` and `psql`, on a fresh,
//! empty database. Then `subscriptions` (`--no-relay`), `billing` (its
//! in-process relay on, as shipped) and `outbox-relay` run as processes under
//! the login roles the snippet made: a subscription created through
//! subscriptions' HTTP API is invoiced by billing, and none of the three logs
//! a warning or an error at start. Running the migration step again changes
//! nothing.

use std::path::Path;
use std::time::Duration;

use outbox_testkit::{NatsServer, Program, TestDb, create_database, wait_until};
use sqlx::PgPool;

use super::grants::{as_user, count, http, log_dir, log_of, start_subscriptions};

const SECURITY_MD: &str = include_str!("../../../docs/security.md");

/// The login roles the snippet creates (cluster-wide).
const LOGINS: [&str; 3] = ["relay_login", "subscriptions_login", "billing_login"];

/// The first fenced block of `lang` in the page's "Least privilege" section
/// whose first line starts with `first`.
fn block(lang: &str, first: &str) -> String {
    let section = SECURITY_MD
        .split("## Least privilege")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("docs/security.md has a `## Least privilege` section");
    let fence = format!("```{lang}\n");
    section
        .split(&fence)
        .skip(1)
        .filter_map(|rest| rest.split("\n```").next())
        .find(|body| body.starts_with(first))
        .unwrap_or_else(|| panic!("no ```{lang} block starting with `{first}` in docs/security.md"))
        .to_owned()
        + "\n"
}

/// A directory where the snippet runs as it would at the repository's root:
/// `examples/` and `ops/` linked in, `logins.sql` written from the page.
fn workdir(dir: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for name in ["examples", "ops"] {
        let link = dir.join(name);
        if !link.exists() {
            std::os::unix::fs::symlink(root.join(name), &link).unwrap();
        }
    }
    std::fs::write(dir.join("logins.sql"), block("sql", "-- logins.sql")).unwrap();
}

/// Runs the page's `sh` block with bash as the owner; its output.
async fn run_sh(dir: &Path, owner_url: &str) -> String {
    let script = block("sh", "# 1. The schema");
    let bin = super::support::bin_dir();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new("bash")
            .args(["-e", "-o", "pipefail", "-c", &script])
            .current_dir(dir)
            .env("PATH", path)
            .env("OWNER_DATABASE_URL", owner_url)
            .env("RELAY_DB_PASSWORD", "relay secret")
            .env("SUBSCRIPTIONS_DB_PASSWORD", "subscriptions' secret")
            .env("BILLING_DB_PASSWORD", "billing;secret")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the snippet did not finish within 120 s")
    .expect("bash runs (install it, and psql: apt-get install postgresql-client)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "docs/security.md's snippet failed ({}):\n{script}\n---\n{text}",
        out.status
    );
    text
}

/// The lines at WARN or ERROR in `log`, but for the single-server NATS of
/// the test (a stream of 1 replica is warned on, as it should be).
fn warnings(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .filter(|l| !l.contains("the stream has 1 replica"))
        .collect()
}

async fn drop_logins(admin: &PgPool, databases: &[&PgPool]) {
    let logins = LOGINS.join(", ");
    for pool in databases {
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("drop owned by {logins}")))
            .execute(*pool)
            .await;
    }
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("drop role if exists {logins}")))
        .execute(admin)
        .await;
}

#[tokio::test]
async fn the_roles_snippet_of_the_security_page_runs_as_written() {
    let nats = tokio::task::spawn_blocking(NatsServer::start)
        .await
        .unwrap()
        .unwrap();
    let anchor = TestDb::new().await.unwrap();
    let name = format!("{}_snippet", anchor.name());
    let url = create_database(anchor.url(), &name).await.unwrap();
    let pool = PgPool::connect(&url).await.unwrap();
    drop_logins(&anchor.pool, &[]).await;
    let dir = log_dir(&name);
    workdir(&dir);

    let first = run_sh(&dir, &url).await;
    for said in [
        "examples/subscriptions/migrations: applied 1 of 1",
        "examples/billing/migrations: applied 1 of 1",
        "outbox schema: applied",
    ] {
        assert!(first.contains(said), "not `{said}`:\n{first}");
    }

    let mut relay = Program::new(
        "relay",
        super::support::bin_dir().join("outbox-relay"),
        &dir,
    )
    .env("DATABASE_URL", as_user(&url, "relay_login"))
    .env("NATS_URL", nats.url())
    .args([
        "--poll-interval",
        "100ms",
        "--subjects",
        "subscription.>,invoice.>",
    ]);
    relay.start().await.unwrap();
    let (mut subscriptions, addr) =
        start_subscriptions(&dir, &as_user(&url, "subscriptions_login")).await;
    let mut billing = Program::new("billing", super::support::bin_dir().join("billing"), &dir)
        .env("DATABASE_URL", as_user(&url, "billing_login"))
        .env("NATS_URL", nats.url())
        .ready_when("billing ready");
    billing
        .start()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&dir, "billing")));

    let body = r#"{"customer_id":"cust_doc","plan":"pro","amount_cents":1200}"#;
    let (status, json) = http(&addr, "POST", "/v1/subscriptions", body).await;
    assert_eq!(status, 201, "{json}\n{}", log_of(&dir, "subscriptions"));
    let id = json["id"].as_str().unwrap().to_owned();
    wait_until(
        "billing invoices the subscription",
        Duration::from_secs(60),
        || {
            let (pool, id) = (&pool, &id);
            async move {
                count(
                    pool,
                    "select count(*) from invoices where subscription_id = $1",
                    id,
                )
                .await
                    == 1
            }
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
    // billing's own invoice.created, published by its in-process relay or
    // outbox-relay.
    wait_until("every outbox row published", Duration::from_secs(30), || {
        let pool = &pool;
        async move {
            count(
                pool,
                "select count(*) from outbox_events where published_at is null and event_type like $1",
                "%",
            )
            .await
                == 0
        }
    })
    .await
    .unwrap();

    for p in [&mut billing, &mut subscriptions, &mut relay] {
        let code = p.terminate().await;
        assert_eq!(code, Some(0), "{}:\n{}", p.name, log_of(&dir, &p.name));
    }
    for name in ["relay", "subscriptions", "billing"] {
        let log = log_of(&dir, name);
        assert!(warnings(&log).is_empty(), "{name} warned:\n{log}");
        assert!(!log.contains("already exists, skipping"), "{name}:\n{log}");
    }
    for name in ["subscriptions", "billing"] {
        let log = log_of(&dir, name);
        let said: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("outbox schema"))
            .collect();
        assert_eq!(said.len(), 1, "{name}:\n{log}");
        assert!(
            said[0].contains("outbox schema up to date") && said[0].contains("left to the owner"),
            "{name}:\n{log}"
        );
    }

    // The migration step again: nothing to do.
    let again = tokio::process::Command::new(super::support::bin_dir().join("outboxctl"))
        .args(["migrate", "--sql-dir"])
        .arg(dir.join("examples/billing/migrations"))
        .env("DATABASE_URL", &url)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&again.stdout);
    assert!(again.status.success(), "{text}");
    assert!(text.contains("outbox schema up to date"), "{text}");
    assert!(text.contains("up to date (1 migrations"), "{text}");

    pool.close().await;
    drop_logins(&anchor.pool, &[&anchor.pool]).await;
    let admin = PgPool::connect(anchor.url()).await.unwrap();
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "drop database if exists \"{name}\" with (force)"
    )))
    .execute(&admin)
    .await;
    drop_logins(&admin, &[]).await;
}
