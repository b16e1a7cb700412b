//! `outboxctl migrate`, the shipped binary against a fresh database: the
//! outbox's migrations and a directory of the service's own, applied as the
//! connecting role; a second run changes nothing; a failing file is named
//! and nothing of the directory's pending files is applied; a file changed
//! after it was applied is refused; the URL's `search_path` chooses the
//! schema.

use std::path::Path;

use outbox_testkit::{TestDb, create_database};
use serde_json::Value;
use sqlx::PgPool;

use super::outbox::ctl;
use crate::support::relation_exists as exists;

fn write(dir: &Path, name: &str, sql: &str) {
    std::fs::write(dir.join(name), sql).unwrap();
}

fn names(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn migrate_applies_the_outbox_s_and_the_service_s_files_once_or_not_at_all() {
    let anchor = TestDb::new().await.unwrap();
    let url = create_database(anchor.url(), &format!("{}_ctl_migrate", anchor.name()))
        .await
        .unwrap();
    let pool = PgPool::connect(&url).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dir_arg = dir.path().to_str().unwrap().to_owned();
    write(
        dir.path(),
        "20260301000001_accounts.sql",
        "create table accounts (id text primary key);",
    );
    write(
        dir.path(),
        "20260301000002_ledger.sql",
        "create table ledger (id bigint primary key, account text references accounts);",
    );
    write(dir.path(), "README.md", "not a migration");

    let total = outbox_pg::MIGRATOR.iter().count();
    let first = ctl(&url, &["--json", "migrate", "--sql-dir", &dir_arg])
        .await
        .ok();
    assert_eq!(names(&first["outbox"]["applied"]).len(), total, "{first}");
    assert_eq!(
        names(&first["sql_dir"]["applied"]),
        ["20260301000001_accounts.sql", "20260301000002_ledger.sql"],
        "{first}"
    );
    assert_eq!(first["sql_dir"]["table"], "_sqlx_migrations");
    for relation in ["outbox_events", "inbox_events", "accounts", "ledger"] {
        assert!(exists(&pool, relation).await, "{relation}");
    }

    // Again: nothing to do, said as such.
    let again = ctl(&url, &["--json", "migrate", "--sql-dir", &dir_arg])
        .await
        .ok();
    assert!(names(&again["outbox"]["applied"]).is_empty(), "{again}");
    assert!(names(&again["sql_dir"]["applied"]).is_empty(), "{again}");
    let text = ctl(&url, &["migrate", "--sql-dir", &dir_arg]).await;
    assert!(text.status.success(), "{}", text.stderr);
    assert!(
        text.stdout
            .contains(&format!("outbox schema up to date ({total} migrations)")),
        "{}",
        text.stdout
    );
    assert!(
        text.stdout
            .contains("up to date (2 migrations, recorded in _sqlx_migrations)"),
        "{}",
        text.stdout
    );

    // A good file and a failing one: the failing one named, neither applied.
    write(
        dir.path(),
        "20260301000003_notes.sql",
        "create table notes (id text primary key);",
    );
    write(
        dir.path(),
        "20260301000004_broken.sql",
        "create table broken (id text primary key);\nselect no_such_function();",
    );
    let (kind, message) = ctl(&url, &["--json", "migrate", "--sql-dir", &dir_arg])
        .await
        .error();
    assert_eq!(kind, "database", "{message}");
    assert!(message.contains("20260301000004_broken.sql"), "{message}");
    assert!(message.contains("no_such_function"), "{message}");
    assert!(!message.contains(" at line "), "{message}");
    assert!(!exists(&pool, "notes").await && !exists(&pool, "broken").await);
    let recorded: i64 = sqlx::query_scalar("select count(*) from _sqlx_migrations")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(recorded, 2);

    // Fixed, it applies both.
    write(
        dir.path(),
        "20260301000004_broken.sql",
        "create table broken (id text primary key);",
    );
    let fixed = ctl(&url, &["--json", "migrate", "--sql-dir", &dir_arg])
        .await
        .ok();
    assert_eq!(names(&fixed["sql_dir"]["applied"]).len(), 2, "{fixed}");

    // A file changed after it was applied: refused, named.
    write(
        dir.path(),
        "20260301000001_accounts.sql",
        "create table accounts (id text primary key, name text);",
    );
    let (_, message) = ctl(&url, &["--json", "migrate", "--sql-dir", &dir_arg])
        .await
        .error();
    assert!(
        message.contains("20260301000001_accounts.sql") && message.contains("changed"),
        "{message}"
    );

    // Not a directory: refused before anything runs.
    let (kind, message) = ctl(&url, &["--json", "migrate", "--sql-dir", "/no/such/dir"])
        .await
        .error();
    assert_eq!(kind, "config", "{message}");
    pool.close().await;
}

#[tokio::test]
async fn migrate_applies_in_the_schema_the_url_s_search_path_names() {
    let anchor = TestDb::new().await.unwrap();
    let url = create_database(anchor.url(), &format!("{}_ctl_tenant", anchor.name()))
        .await
        .unwrap();
    let pool = PgPool::connect(&url).await.unwrap();
    sqlx::query("create schema tenant")
        .execute(&pool)
        .await
        .unwrap();
    let tenant = format!("{url}?options=-csearch_path%3Dtenant");
    ctl(&tenant, &["--json", "migrate"]).await.ok();
    assert!(exists(&pool, "tenant.outbox_events").await);
    assert!(exists(&pool, "tenant.outbox_schema_migrations").await);
    assert!(!exists(&pool, "public.outbox_events").await);
    pool.close().await;
}
