//! Fresh databases (in `public` or in a schema of their own), the service
//! binary, and the checks every scenario ends with.

use std::path::PathBuf;
use std::time::Duration;

use existing_service::{APP_MIGRATOR, Order};
use outbox_pg::{MIGRATION_TABLE, MIGRATOR};
use outbox_testkit::{TestDb, create_database};
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::PgPoolOptions;

/// The outbox's migrations as an earlier release embedded them (the files of
/// `migrations/` before they moved into `outbox-pg/` and became idempotent),
/// recorded in `_sqlx_migrations` as that release's `outbox_pg::migrate` did.
pub(crate) static EARLIER_RELEASE: Migrator = sqlx::migrate!("./tests/fixtures/outbox-pg-0.1");

/// The schema the non-`public` scenarios put everything in.
pub(crate) const TENANT: &str = "tenant";

/// The outbox's tables, for placement and fingerprint checks.
pub(crate) const OUTBOX_TABLES: &[&str] = &[
    "outbox_events",
    "inbox_events",
    "inbox_dead_letters",
    "inbox_leases",
];

/// Where a scenario's database keeps its tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// The default `search_path`: everything in `public`.
    Public,
    /// `search_path=tenant` in the connection URL (`options`), for every
    /// connection: the service's, the library's, psql's.
    Tenant,
}

impl Target {
    pub(crate) fn schema(self) -> &'static str {
        match self {
            Target::Public => "public",
            Target::Tenant => TENANT,
        }
    }
}

/// A new, empty database; for [`Target::Tenant`] with the schema created and
/// the URL setting the `search_path` to it.
#[derive(Debug)]
pub(crate) struct Db {
    pub(crate) url: String,
    pub(crate) pool: PgPool,
    pub(crate) target: Target,
    pub(crate) name: String,
}

/// A migrated database of the test binary's PostgreSQL server, kept only for
/// its server (the URL to create fresh ones with).
pub(crate) async fn server() -> TestDb {
    TestDb::new().await.unwrap()
}

pub(crate) async fn fresh(server: &TestDb, target: Target) -> Db {
    let id = uuid::Uuid::now_v7().simple().to_string();
    let name = format!("existing_{}", &id[id.len() - 16..]);
    let url = create_database(server.url(), &name).await.unwrap();
    let url = match target {
        Target::Public => url,
        Target::Tenant => {
            let plain = PgPool::connect(&url).await.unwrap();
            sqlx::query(sqlx::AssertSqlSafe(format!("create schema {TENANT}")))
                .execute(&plain)
                .await
                .unwrap();
            plain.close().await;
            let sep = if url.contains('?') { '&' } else { '?' };
            format!("{url}{sep}options=-csearch_path%3D{TENANT}")
        }
    };
    let pool = PgPoolOptions::new()
        .max_connections(5)
        .connect(&url)
        .await
        .unwrap();
    let schema: String = sqlx::query_scalar("select current_schema()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(schema, target.schema(), "{url}");
    Db {
        url,
        pool,
        target,
        name,
    }
}

/// Runs the service binary once with `order`; its stdout, or what went wrong.
pub(crate) async fn run(db: &Db, order: Order) -> Result<String, String> {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_existing-service"))
        .arg(order.as_str())
        .env("DATABASE_URL", &db.url)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), child)
        .await
        .map_err(|_| format!("{order}: still running after 60 s"))?
        .map_err(|e| format!("{order}: cannot run: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() && stdout.starts_with("ok ") {
        Ok(stdout)
    } else {
        Err(format!(
            "{order} on {}: {}\nstdout: {stdout}\nstderr: {}",
            db.name,
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

pub(crate) async fn run_ok(db: &Db, order: Order) {
    if let Err(e) = run(db, order).await {
        panic!("{e}");
    }
}

/// `(version, execution_time)` of every row of the outbox's history table.
pub(crate) async fn recorded(db: &Db) -> Vec<(i64, i64)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "select version, execution_time from {MIGRATION_TABLE} where success order by version"
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// Versions in `_sqlx_migrations`; empty when there is no such table.
pub(crate) async fn sqlx_versions(db: &Db) -> Vec<i64> {
    if !exists(db, "_sqlx_migrations").await {
        return Vec::new();
    }
    sqlx::query_scalar("select version from _sqlx_migrations order by version")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

pub(crate) async fn exists(db: &Db, relation: &str) -> bool {
    sqlx::query_scalar("select to_regclass($1) is not null")
        .bind(relation)
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

pub(crate) fn outbox_versions() -> Vec<i64> {
    MIGRATOR.iter().map(|m| m.version).collect()
}

pub(crate) fn app_versions() -> Vec<i64> {
    APP_MIGRATOR.iter().map(|m| m.version).collect()
}

/// Whose history holds the outbox's files besides its own table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SqlxHistory {
    /// `_sqlx_migrations` holds the service's versions only.
    AppOnly,
    /// The service's and ours (the service's tool applied our files).
    AppAndOutbox,
}

/// The end state every scenario must reach: every outbox file recorded once
/// in its own table (unless only the service's tool ran them); `_sqlx_migrations` as `history` says; every table, the
/// sequence, the functions and both histories in the target schema and (for
/// a schema of its own) nothing in `public`; the outbox's schema exactly the
/// earlier release's (`fingerprint`); and `orders` orders, each with its
/// event, numbered by the `seq` trigger without gaps or repeats.
pub(crate) async fn assert_complete(
    db: &Db,
    history: SqlxHistory,
    orders: i64,
    reference: &[String],
) {
    // Only the service's tool ran our files: the library never did, and its
    // table does not exist.
    let tool_only = history == SqlxHistory::AppAndOutbox && !exists(db, MIGRATION_TABLE).await;
    if !tool_only {
        let ours: Vec<i64> = recorded(db).await.into_iter().map(|(v, _)| v).collect();
        assert_eq!(ours, outbox_versions(), "{}: {MIGRATION_TABLE}", db.name);
    }
    let mut expected = app_versions();
    if history == SqlxHistory::AppAndOutbox {
        expected.extend(outbox_versions());
        expected.sort_unstable();
    }
    assert_eq!(
        sqlx_versions(db).await,
        expected,
        "{}: _sqlx_migrations",
        db.name
    );
    assert_placed(db).await;
    assert_eq!(
        fingerprint(db).await,
        reference,
        "{}: outbox schema",
        db.name
    );
    let (placed, events, seqs): (i64, i64, Vec<i64>) = sqlx::query_as(
        "select (select count(*) from orders), (select count(*) from outbox_events),
                (select coalesce(array_agg(seq order by seq), '{}') from outbox_events)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (placed, events),
        (orders, orders),
        "{}: orders and events",
        db.name
    );
    let from = seqs.first().copied().unwrap_or(1);
    assert_eq!(
        seqs,
        (from..from + orders).collect::<Vec<_>>(),
        "{}: seq",
        db.name
    );
}

/// Every relation of the outbox, of the service and both histories (ours
/// where the library ran) lives in the target schema; with a schema of its own, `public` holds nothing.
pub(crate) async fn assert_placed(db: &Db) {
    let mut names: Vec<&str> = OUTBOX_TABLES.to_vec();
    names.extend([
        "outbox_events_seq",
        "outbox_events_shard_seq_idx",
        "_sqlx_migrations",
        "customers",
        "orders",
    ]);
    if exists(db, MIGRATION_TABLE).await {
        names.push(MIGRATION_TABLE);
    }
    for name in names {
        let schema: Option<String> = sqlx::query_scalar(
            "select n.nspname::text from pg_class c join pg_namespace n on n.oid = c.relnamespace
              where c.oid = to_regclass($1)",
        )
        .bind(name)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            schema.as_deref(),
            Some(db.target.schema()),
            "{}: `{name}`",
            db.name
        );
    }
    if db.target != Target::Public {
        let (relations, functions): (i64, i64) = sqlx::query_as(
            "select (select count(*) from pg_class where relnamespace = 'public'::regnamespace),
                    (select count(*) from pg_proc where pronamespace = 'public'::regnamespace)",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!((relations, functions), (0, 0), "{}: public holds", db.name);
    }
}

/// The outbox's schema in the session's schema, without the schema's name:
/// every column (type, nullability, default, generation, position), index,
/// constraint, trigger, function, sequence and storage setting of its
/// tables, one line each, sorted.
pub(crate) async fn fingerprint(db: &Db) -> Vec<String> {
    sqlx::query_scalar(
        r"
with t as (
  select c.oid, c.relname from pg_class c
   where c.relnamespace = current_schema()::regnamespace and c.relname = any($1)
)
select replace(line, current_schema() || '.', '') from (
  select format('column %s.%s %s %s default=%s generated=%s #%s', t.relname, a.attname,
                format_type(a.atttypid, a.atttypmod), a.attnotnull,
                pg_get_expr(d.adbin, d.adrelid), a.attgenerated, a.attnum) as line
    from t join pg_attribute a on a.attrelid = t.oid
    left join pg_attrdef d on d.adrelid = a.attrelid and d.adnum = a.attnum
   where a.attnum > 0 and not a.attisdropped
  union all
  select 'index ' || pg_get_indexdef(i.indexrelid) from t join pg_index i on i.indrelid = t.oid
  union all
  select format('constraint %s.%s %s', t.relname, c.conname, pg_get_constraintdef(c.oid))
    from t join pg_constraint c on c.conrelid = t.oid
  union all
  select 'trigger ' || pg_get_triggerdef(g.oid) from t join pg_trigger g on g.tgrelid = t.oid
   where not g.tgisinternal
  union all
  select format('options %s %s', t.relname, c.reloptions) from t join pg_class c on c.oid = t.oid
  union all
  select format('function %s %s %s', p.proname, pg_get_function_result(p.oid), p.prosrc)
    from pg_proc p where p.pronamespace = current_schema()::regnamespace
  union all
  select format('sequence %s %s %s %s %s %s', c.relname, s.seqtypid::regtype, s.seqstart,
                s.seqincrement, s.seqmax, s.seqcycle)
    from pg_sequence s join pg_class c on c.oid = s.seqrelid
   where c.relnamespace = current_schema()::regnamespace
) lines
order by 1",
    )
    .bind(OUTBOX_TABLES)
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

/// The fingerprint of a database migrated by the earlier release and then by
/// the files added since (each as it is, with psql's semantics of one
/// statement batch), the schema every scenario must end with.
pub(crate) async fn reference(server: &TestDb) -> Vec<String> {
    let db = fresh(server, Target::Public).await;
    EARLIER_RELEASE.run(&db.pool).await.unwrap();
    let last_earlier = EARLIER_RELEASE.iter().map(|m| m.version).max().unwrap();
    for m in MIGRATOR.iter().filter(|m| m.version > last_earlier) {
        sqlx::raw_sql(m.sql.clone())
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let lines = fingerprint(&db).await;
    assert!(lines.len() > 40, "{lines:#?}");
    db.pool.close().await;
    lines
}

/// The earlier release's start-up: its first `files` migrations applied and
/// recorded in `_sqlx_migrations`, as its `outbox_pg::migrate` did.
pub(crate) async fn earlier_release_migrate(db: &Db, files: usize) {
    let migrator = Migrator::with_migrations(EARLIER_RELEASE.iter().take(files).cloned().collect());
    migrator.run(&db.pool).await.unwrap();
}

/// The directory of a fixture or of the outbox's files.
pub(crate) fn outbox_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(existing_service::outbox_migrations_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "sql"))
        .collect();
    files.sort();
    assert_eq!(files.len(), MIGRATOR.iter().count());
    files
}

/// `psql`: from `PG_BIN_DIR`, the newest `/usr/lib/postgresql/*/bin`, or `PATH`.
pub(crate) fn psql() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN_DIR") {
        return PathBuf::from(dir).join("psql");
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((v, e.path().join("bin/psql")))
        })
        .filter(|(_, p)| p.is_file())
        .collect();
    versions.sort();
    versions
        .pop()
        .map_or_else(|| PathBuf::from("psql"), |(_, p)| p)
}

/// Applies every outbox file with `psql --single-transaction -f`, in file
/// name order, as a deployment script outside Rust would.
pub(crate) async fn psql_each_file(db: &Db) {
    for file in outbox_files() {
        let out = tokio::process::Command::new(psql())
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "--single-transaction"])
            .arg("-d")
            .arg(&db.url)
            .arg("-f")
            .arg(&file)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "psql -f {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
