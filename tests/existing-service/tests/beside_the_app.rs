//! An existing service, with sqlx migrations of its own, takes up the outbox:
//! its `sqlx::migrate!` and `outbox_pg::migrate` in either order, twice, two
//! processes at once, the outbox's files run by the service's own sqlx
//! migrator or by psql before or after the library, and a database an
//! earlier release migrated (our rows in `_sqlx_migrations`). Every scenario
//! runs in `public` (`public::…`) and in a schema of its own reached through
//! the `search_path` (`in_a_schema::…`), and ends with the same schema as the
//! earlier release built, the same in every case.
//!
//! `EXISTING_SERVICE_ROUNDS` sets the rounds of the start-together test
//! (default 4).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod support;

use existing_service::{APP_MIGRATOR, Order, place_order};
use outbox_pg::{MIGRATION_TABLE, MIGRATOR};
use sqlx::migrate::Migrator;
use support::{
    Db, EARLIER_RELEASE, SqlxHistory, Target, assert_complete, earlier_release_migrate, exists,
    fresh, psql_each_file, recorded, reference, run, run_ok, server, sqlx_versions,
};

/// Each scenario once in `public` and once in a schema of its own.
macro_rules! in_both_schemas {
    ($($scenario:ident),* $(,)?) => {
        mod public {
            $(#[tokio::test]
            async fn $scenario() {
                super::$scenario(super::Target::Public).await;
            })*
        }
        mod in_a_schema {
            $(#[tokio::test]
            async fn $scenario() {
                super::$scenario(super::Target::Tenant).await;
            })*
        }
    };
}

in_both_schemas!(
    either_order_twice_on_one_database,
    two_processes_started_together_on_a_fresh_database,
    the_service_tool_then_the_library,
    the_library_then_the_service_tool,
    psql_each_file_then_the_library,
    an_earlier_release_is_adopted,
    an_earlier_release_with_fewer_files_is_adopted_and_completed,
);

fn rounds() -> usize {
    std::env::var("EXISTING_SERVICE_ROUNDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(4)
}

/// App first twice, then outbox first twice, on one database; and the other
/// way round on another: neither migrator trips over the other's history.
async fn either_order_twice_on_one_database(target: Target) {
    let server = server().await;
    let reference = reference(&server).await;
    for (first, then) in [
        (Order::AppFirst, Order::OutboxFirst),
        (Order::OutboxFirst, Order::AppFirst),
    ] {
        let db = fresh(&server, target).await;
        run_ok(&db, first).await;
        run_ok(&db, first).await;
        assert_complete(&db, SqlxHistory::AppOnly, 2, &reference).await;
        run_ok(&db, then).await;
        run_ok(&db, then).await;
        assert_complete(&db, SqlxHistory::AppOnly, 4, &reference).await;
    }
}

/// Two replicas started at the same instant on a fresh database, several
/// rounds per pairing; each must migrate and write. The last pairing is the
/// service's sqlx migrator running our files (holding sqlx's lock, taking
/// ours inside each file) beside a process of the same deployment calling
/// `outbox_pg::migrate` (holding ours): they must take turns, not deadlock.
async fn two_processes_started_together_on_a_fresh_database(target: Target) {
    let server = server().await;
    let reference = reference(&server).await;
    let pairings = [
        (Order::AppFirst, Order::AppFirst),
        (Order::OutboxFirst, Order::OutboxFirst),
        (Order::AppFirst, Order::OutboxFirst),
        (Order::AppTool, Order::AppTool),
    ];
    let mut failures = Vec::new();
    for round in 1..=rounds() {
        for (a, b) in pairings {
            let db = fresh(&server, target).await;
            let (ra, rb) = tokio::join!(run(&db, a), run(&db, b));
            for r in [ra, rb] {
                if let Err(e) = r {
                    failures.push(format!("round {round}, {a} + {b}: {e}"));
                }
            }
            let history = if a == Order::AppTool {
                SqlxHistory::AppAndOutbox
            } else {
                SqlxHistory::AppOnly
            };
            if failures.is_empty() {
                assert_complete(&db, history, 2, &reference).await;
            }
        }
        let db = fresh(&server, target).await;
        let (tool, library) = tokio::join!(run(&db, Order::AppTool), outbox_pg::migrate(&db.pool));
        if let Err(e) = tool {
            failures.push(format!("round {round}, app-tool + library: {e}"));
        }
        if let Err(e) = library {
            failures.push(format!("round {round}, library + app-tool: {e}"));
        }
        if failures.is_empty() {
            assert_complete(&db, SqlxHistory::AppAndOutbox, 1, &reference).await;
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The service's own sqlx migrator applies our files from its folder; a
/// start-up `outbox_pg::migrate` afterwards runs none of them again (it
/// records them, `execution_time` -1) and leaves the service's rows, ours
/// among them, as they are; the service's tool then still starts.
async fn the_service_tool_then_the_library(target: Target) {
    let server = server().await;
    let reference = reference(&server).await;
    let db = fresh(&server, target).await;
    run_ok(&db, Order::AppTool).await;
    assert!(!exists(&db, MIGRATION_TABLE).await);
    let before = sqlx_rows(&db).await;
    outbox_pg::migrate(&db.pool).await.unwrap();
    assert!(
        recorded(&db).await.iter().all(|(_, time)| *time == -1),
        "{:?}: the library ran a file the service's tool had applied",
        recorded(&db).await
    );
    assert_eq!(sqlx_rows(&db).await, before, "_sqlx_migrations changed");
    run_ok(&db, Order::AppTool).await;
    outbox_pg::migrate(&db.pool).await.unwrap();
    assert_complete(&db, SqlxHistory::AppAndOutbox, 2, &reference).await;
}

/// The library first; then the service's tool runs our files too (its own
/// history does not have them), changing nothing; then both again.
async fn the_library_then_the_service_tool(target: Target) {
    let server = server().await;
    let reference = reference(&server).await;
    let db = fresh(&server, target).await;
    outbox_pg::migrate(&db.pool).await.unwrap();
    let first = recorded(&db).await;
    let before = fingerprint_of(&db).await;
    assert_eq!(before, reference);
    run_ok(&db, Order::AppTool).await;
    outbox_pg::migrate(&db.pool).await.unwrap();
    run_ok(&db, Order::AppTool).await;
    assert_eq!(
        recorded(&db).await,
        first,
        "the library recorded anything twice"
    );
    assert_complete(&db, SqlxHistory::AppAndOutbox, 2, &reference).await;
}

/// A deployment script applies every file with psql, no history at all; the
/// service then starts (the library runs each file again, a no-op, and records
/// it), in both orders; then psql once more, after the library.
async fn psql_each_file_then_the_library(target: Target) {
    let server = server().await;
    let reference = reference(&server).await;
    let db = fresh(&server, target).await;
    psql_each_file(&db).await;
    assert_eq!(fingerprint_of(&db).await, reference);
    run_ok(&db, Order::OutboxFirst).await;
    run_ok(&db, Order::AppFirst).await;
    psql_each_file(&db).await;
    run_ok(&db, Order::AppFirst).await;
    assert_complete(&db, SqlxHistory::AppOnly, 3, &reference).await;
}

/// A database an earlier release migrated: our seven files recorded in
/// `_sqlx_migrations` with that release's checksums (SHA-384 of each file's
/// text), beside the service's own rows (written with `set_ignore_missing`,
/// the only way the two could share that table), and orders already placed.
/// The first start of this release adopts our rows and removes them, and
/// only them; the service's own migrator then runs in either order.
async fn an_earlier_release_is_adopted(target: Target) {
    let server = server().await;
    let reference = reference(&server).await;
    let db = fresh(&server, target).await;
    earlier_release_migrate(&db, 7).await;
    assert_earlier_rows(&db, 7).await;
    app_migrate_ignoring_missing(&db).await;
    place_order(&db.pool).await.unwrap();
    place_order(&db.pool).await.unwrap();
    let app_rows = sqlx_rows(&db).await;

    // The service's own migrator fails until the library has run once: the
    // reason to call `outbox_pg::migrate` first on the first start.
    let err = run(&db, Order::AppFirst).await.unwrap_err();
    assert!(err.contains("previously applied but is missing"), "{err}");

    run_ok(&db, Order::OutboxFirst).await;
    let app_only: Vec<String> = app_rows
        .iter()
        .filter(|r| !is_outbox_row(r))
        .cloned()
        .collect();
    assert_eq!(app_only.len(), APP_MIGRATOR.iter().count());
    assert_eq!(sqlx_rows(&db).await, app_only, "the service's rows changed");
    // The release's files adopted (recorded, not run: time -1); the files
    // added since run.
    let adopted: Vec<i64> = EARLIER_RELEASE.iter().map(|m| m.version).collect();
    assert!(
        recorded(&db)
            .await
            .iter()
            .all(|(version, time)| (*time == -1) == adopted.contains(version)),
        "adopted files were run again, or newer ones not run: {:?}",
        recorded(&db).await
    );
    run_ok(&db, Order::AppFirst).await;
    run_ok(&db, Order::OutboxFirst).await;
    assert_complete(&db, SqlxHistory::AppOnly, 5, &reference).await;
}

/// An older release still, with four files: the first four are adopted, the
/// other three applied (`outbox_events.seq` filled in for the events already
/// there, in their `created_at` order, and the sequence continuing after them).
async fn an_earlier_release_with_fewer_files_is_adopted_and_completed(target: Target) {
    let server = server().await;
    let reference = reference(&server).await;
    let db = fresh(&server, target).await;
    earlier_release_migrate(&db, 4).await;
    assert_earlier_rows(&db, 4).await;
    app_migrate_ignoring_missing(&db).await;
    for _ in 0..3 {
        place_order(&db.pool).await.unwrap();
    }
    run_ok(&db, Order::OutboxFirst).await;
    let times: Vec<i64> = recorded(&db).await.into_iter().map(|(_, t)| t).collect();
    assert_eq!(&times[..4], &[-1; 4], "adopted");
    assert!(times[4..].iter().all(|t| *t >= 0), "applied: {times:?}");
    assert_eq!(sqlx_versions(&db).await, support::app_versions());
    run_ok(&db, Order::AppFirst).await;
    assert_complete(&db, SqlxHistory::AppOnly, 5, &reference).await;
}

/// Rows of `_sqlx_migrations` that are not ours stay: one with our version
/// and another description, one with our description and another version.
#[tokio::test]
async fn rows_that_are_not_ours_stay_in_sqlx_migrations() {
    let server = server().await;
    let db = fresh(&server, Target::Public).await;
    // An empty `_sqlx_migrations`, created as sqlx creates it.
    Migrator::with_migrations(Vec::new())
        .run(&db.pool)
        .await
        .unwrap();
    sqlx::query(
        "insert into _sqlx_migrations (version, description, success, checksum, execution_time)
         values (20260101000006, 'inbox sequence of another tool', true, '\\x00', 1),
                (20250505000000, 'outbox events', true, '\\x01', 1)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let before = sqlx_rows(&db).await;
    outbox_pg::migrate(&db.pool).await.unwrap();
    assert_eq!(sqlx_rows(&db).await, before);
    let times: Vec<i64> = recorded(&db).await.into_iter().map(|(_, t)| t).collect();
    assert!(times.iter().all(|t| *t >= 0), "nothing adopted: {times:?}");
}

/// Both ways across binaries: one binary's migrator applied copies of our
/// files (recording them in `_sqlx_migrations`), another's lacks them. That
/// one's sqlx error ("previously applied but is missing") is explained as
/// what it is, naming our file and both remedies; the remedy it names (the
/// rows removed, the library in every binary) then works.
#[tokio::test]
async fn a_binary_without_the_copies_is_told_the_ways_were_mixed() {
    let server = server().await;
    let db = fresh(&server, Target::Public).await;
    run_ok(&db, Order::AppTool).await;
    let e = existing_service::migrate(&db.pool, Order::AppFirst)
        .await
        .unwrap_err()
        .to_string();
    let first = MIGRATOR.iter().map(|m| m.version).min().unwrap();
    for words in [
        format!("the outbox migration {first}_"),
        "applied both ways".to_owned(),
        "outbox_pg::migrate in every binary".to_owned(),
        "delete from _sqlx_migrations where version between".to_owned(),
    ] {
        assert!(e.contains(&words), "{words:?} not in: {e}");
    }
    let last = MIGRATOR.iter().map(|m| m.version).max().unwrap();
    sqlx::query("delete from _sqlx_migrations where version between $1 and $2")
        .bind(first)
        .bind(last)
        .execute(&db.pool)
        .await
        .unwrap();
    outbox_pg::migrate(&db.pool).await.unwrap();
    existing_service::migrate(&db.pool, Order::AppFirst)
        .await
        .unwrap();
    existing_service::migrate(&db.pool, Order::OutboxFirst)
        .await
        .unwrap();
}

/// The library alone creates its own history and no `_sqlx_migrations`.
#[tokio::test]
async fn the_library_alone_leaves_no_sqlx_history() {
    let server = server().await;
    let db = fresh(&server, Target::Public).await;
    outbox_pg::migrate(&db.pool).await.unwrap();
    outbox_pg::migrate(&db.pool).await.unwrap();
    assert!(!exists(&db, "_sqlx_migrations").await);
    assert_eq!(recorded(&db).await.len(), MIGRATOR.iter().count());
}

/// The `search_path` set on the role (for this database) instead of in the
/// URL: the same placement.
#[tokio::test]
async fn a_search_path_set_on_the_role_places_everything_in_that_schema() {
    let server = server().await;
    let reference = reference(&server).await;
    let tenant = fresh(&server, Target::Tenant).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "alter role current_user in database \"{}\" set search_path = {}",
        tenant.name,
        support::TENANT
    )))
    .execute(&tenant.pool)
    .await
    .unwrap();
    let url = tenant
        .url
        .split_once('?')
        .map_or(tenant.url.as_str(), |(u, _)| u)
        .to_owned();
    let db = Db {
        pool: sqlx::PgPool::connect(&url).await.unwrap(),
        url,
        target: Target::Tenant,
        name: tenant.name.clone(),
    };
    run_ok(&db, Order::AppFirst).await;
    run_ok(&db, Order::OutboxFirst).await;
    assert_complete(&db, SqlxHistory::AppOnly, 2, &reference).await;
}

async fn fingerprint_of(db: &Db) -> Vec<String> {
    support::fingerprint(db).await
}

/// The earlier release's rows: our first `files` versions and descriptions,
/// each checksum the SHA-384 of that release's file (computed by PostgreSQL
/// here) and not the checksum of this release's file.
async fn assert_earlier_rows(db: &Db, files: usize) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/outbox-pg-0.1");
    for (old, new) in EARLIER_RELEASE.iter().zip(MIGRATOR.iter()).take(files) {
        let file = format!(
            "{dir}/{}_{}.sql",
            old.version,
            old.description.replace(' ', "_")
        );
        let text = std::fs::read_to_string(&file).unwrap();
        let (matches, description): (bool, String) = sqlx::query_as(
            "select checksum = sha384(convert_to($2, 'UTF8')), description
               from _sqlx_migrations where version = $1 and success",
        )
        .bind(old.version)
        .bind(&text)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert!(matches, "{file}: checksum");
        assert_eq!(
            (old.version, &*description),
            (new.version, &*new.description)
        );
        assert_ne!(*old.checksum, *new.checksum, "{file} did not change");
    }
    assert_eq!(sqlx_versions(db).await.len(), files);
}

/// The service's own migrations, recorded beside ours in `_sqlx_migrations`
/// with `set_ignore_missing(true)`, as a service sharing that table with an
/// earlier release had to.
async fn app_migrate_ignoring_missing(db: &Db) {
    let mut app = Migrator::with_migrations(APP_MIGRATOR.iter().cloned().collect());
    app.set_ignore_missing(true);
    app.run(&db.pool).await.unwrap();
}

/// Every row of `_sqlx_migrations`, whole, as text.
async fn sqlx_rows(db: &Db) -> Vec<String> {
    sqlx::query_scalar("select row_to_json(m)::text from _sqlx_migrations m order by version")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

fn is_outbox_row(row: &str) -> bool {
    MIGRATOR
        .iter()
        .any(|m| row.starts_with(&format!("{{\"version\":{},", m.version)))
}

/// A file that fails is named in the error, rolled back with its history
/// row (the files before it stay recorded), and leaves no lock behind; once
/// the cause is gone, the next start completes.
#[tokio::test]
async fn a_failing_file_is_named_rolled_back_and_leaves_no_lock() {
    let server = server().await;
    let db = fresh(&server, Target::Public).await;
    // A table where file 5 expects its sequence: `create sequence if not
    // exists` passes over it, `setval` fails.
    sqlx::query("create table outbox_events_seq (n int)")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = outbox_pg::migrate(&db.pool).await.unwrap_err();
    assert_eq!(err.kind(), outbox_pg::ErrorKind::Database);
    assert!(
        err.to_string()
            .contains("applying migration 20260101000005_outbox_order_and_shards.sql"),
        "{err}"
    );
    let versions: Vec<i64> = recorded(&db).await.into_iter().map(|(v, _)| v).collect();
    assert_eq!(versions, support::outbox_versions()[..4]);
    assert!(!exists(&db, "outbox_events_shard_seq_idx").await);
    let lock = outbox_pg::MIGRATION_LOCK;
    outbox_testkit::wait_until(
        "the migration lock released",
        std::time::Duration::from_secs(10),
        || async {
            sqlx::query_scalar::<_, i64>(
                "select count(*) from pg_locks
                  where locktype = 'advisory' and classid::text::bigint = $1
                    and objid::text::bigint = $2 and objsubid = 2",
            )
            .bind(i64::from(lock.0))
            .bind(i64::from(lock.1))
            .fetch_one(&db.pool)
            .await
            .unwrap()
                == 0
        },
    )
    .await
    .unwrap();
    sqlx::query("drop table outbox_events_seq")
        .execute(&db.pool)
        .await
        .unwrap();
    run_ok(&db, Order::OutboxFirst).await;
    assert_eq!(recorded(&db).await.len(), MIGRATOR.iter().count());
}
