//! Consumers kept apart in one database, under the least-privilege roles of
//! `ops/sql/roles.sql`: two login roles, each a member of `outbox_consumer`,
//! each owning a consumer it registered through the runtime.
//!
//! - Connected as one, every select, insert, update and delete of the other
//!   consumer's rows in `inbox_events`, `inbox_dead_letters`, `inbox_leases`
//!   and `inbox_consumers`, and a bump of its lease epoch, is refused
//!   (SQLSTATE 42501) or finds nothing; the other's rows are unchanged, and
//!   its own stay its to use. A name whose owner role is gone is no one's.
//! - Both run their runtime under their own roles, one ordered, one batched,
//!   and handle every event once; a consumer started under the role that
//!   does not own its name is refused at start, naming the consumer, its
//!   owner and the role. A name handed to another role while its runtime
//!   runs: every write refused and logged as an error, nothing dead-lettered,
//!   and handled once handed back.
//! - A session of the other role holding an ordered consumer's leader lock
//!   is named (role and pid) by the standby it keeps from leading; once it
//!   lets go, the standby leads.

use std::io::Write;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use inbox_consumer::{
    Consumer, ConsumerConfig, DedupeLayer, ErrorKind, Handler, HandlerError, HandlerService, Router,
};
use outbox_pg::Envelope;
use outbox_testkit::{NatsHandle, TestDb, wait_until};
use serde_json::{Value, json};
use sqlx::{Connection, PgPool, PgTransaction};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::ServiceBuilder;

const ROLES_SQL: &str = include_str!("../../../ops/sql/roles.sql");

const WAIT: Duration = Duration::from_secs(60);

/// The event type every consumer here handles (and the subject it is
/// published on, as the relay does).
const TYPE: &str = "iso.thing";

// ---------------------------------------------------------------------------
// The runtime's log, for what a standby reports.

static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct Capture;

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Captures the consumer runtime's log of this test binary (every test: each
/// reads the lines naming its own consumers).
fn capture_log() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("inbox_consumer=info")
            .with_ansi(false)
            .with_writer(|| Capture)
            .try_init();
    });
}

fn log() -> String {
    String::from_utf8_lossy(&LOG.lock().unwrap()).into_owned()
}

// ---------------------------------------------------------------------------
// The world: one database, two consumer login roles, a stream.

struct World {
    db: TestDb,
    _nats: NatsHandle,
    js: jetstream::Context,
    stream: String,
    /// The login roles (cluster-wide, so named per test database).
    a: String,
    b: String,
    /// A pool of each, as its service would connect.
    pool_a: PgPool,
    pool_b: PgPool,
}

/// `url` with `user` instead of the owner (the test server trusts loopback).
fn as_user(url: &str, user: &str) -> String {
    url.replacen("postgres://postgres@", &format!("postgres://{user}@"), 1)
}

async fn world() -> World {
    capture_log();
    let db = TestDb::new().await.unwrap();
    let tag = db.name().trim_start_matches("outbox_test_")[20..].to_owned();
    for _ in 0..2 {
        sqlx::raw_sql(sqlx::AssertSqlSafe(ROLES_SQL))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let (a, b) = (format!("iso_a_{tag}"), format!("iso_b_{tag}"));
    let sql = format!(
        "create role {a} login; grant outbox_consumer to {a};
         create role {b} login; grant outbox_consumer to {b};
         create table effects (consumer text not null, event_id uuid not null,
                               primary key (consumer, event_id));
         grant select, insert on effects to {a}, {b};"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&db.pool)
        .await
        .unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let stream = format!("ISO_{tag}");
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec!["iso.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let pool_a = PgPool::connect(&as_user(db.url(), &a)).await.unwrap();
    let pool_b = PgPool::connect(&as_user(db.url(), &b)).await.unwrap();
    World {
        db,
        _nats: nats,
        js,
        stream,
        a,
        b,
        pool_a,
        pool_b,
    }
}

impl World {
    fn config(&self, durable: &str) -> ConsumerConfig {
        ConsumerConfig::new(&self.stream, durable)
            .filter_subjects([TYPE])
            .ack_wait(Duration::from_secs(10))
            .lease_timeout(Duration::from_secs(3))
    }

    /// Publishes `n` events as the relay does (body = envelope, `Nats-Msg-Id`
    /// = id), each of its own subject.
    async fn publish(&self, n: usize) {
        let mut acks = Vec::new();
        for i in 0..n {
            let event =
                Envelope::new(TYPE, "tests", format!("thing_{i}"), json!({"i": i})).unwrap();
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", event.id().to_string().as_str());
            acks.push(
                self.js
                    .publish_with_headers(TYPE, headers, event.to_json().unwrap().into())
                    .await
                    .unwrap(),
            );
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }

    /// A count as the tables' owner sees it (every consumer's rows).
    async fn count(&self, sql: &str, consumer: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .bind(consumer)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// Every row of `consumer` in the four tables, as the owner reads them.
    async fn rows_of(&self, consumer: &str) -> Value {
        sqlx::query_scalar(
            "select jsonb_build_object(
               'events', (select jsonb_agg(to_jsonb(e) order by e.event_id)
                            from inbox_events e where e.consumer = $1),
               'dead_letters', (select jsonb_agg(to_jsonb(d) order by d.id)
                                  from inbox_dead_letters d where d.consumer = $1),
               'lease', (select to_jsonb(l) from inbox_leases l where l.consumer = $1),
               'registration', (select to_jsonb(c) from inbox_consumers c where c.consumer = $1))",
        )
        .bind(consumer)
        .fetch_one(&self.db.pool)
        .await
        .unwrap()
    }

    async fn drop_roles(&self) {
        self.pool_a.close().await;
        self.pool_b.close().await;
        let sql = format!(
            "drop owned by {a}, {b}; drop role {a}; drop role {b}",
            a = self.a,
            b = self.b
        );
        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&self.db.pool)
            .await;
    }
}

/// Registers `config`'s consumer through the runtime under `pool`'s role
/// (which claims the name), without running it.
async fn register(w: &World, pool: &PgPool, config: ConsumerConfig) {
    Consumer::new(pool.clone(), w.js.clone(), config)
        .await
        .unwrap();
}

/// A statement run under another consumer's role: `Ok(rows affected)` or the
/// SQLSTATE it was refused with.
async fn try_sql(pool: &PgPool, sql: &str) -> Result<u64, String> {
    sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .map(|done| done.rows_affected())
        .map_err(|e| {
            e.as_database_error()
                .and_then(|d| d.code())
                .map_or_else(|| e.to_string(), |c| c.into_owned())
        })
}

/// Rows of `sql` (a count) `pool`'s role sees.
async fn seen(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// One inbox row, one dead letter and a lease of `consumer`, written under
/// its owner's role, as its runtime would.
async fn rows_for(pool: &PgPool, consumer: &str) {
    let sql = format!(
        "insert into inbox_events (consumer, event_id, event_type, subject, event_time)
         values ('{consumer}', gen_random_uuid(), '{TYPE}', 'thing_0', now());
         insert into inbox_dead_letters
           (consumer, stream, stream_sequence, subject, delivery_count, reason, error, payload)
         values ('{consumer}', 'S', 1, '{TYPE}', 1, 'rejected', 'no', '\\x00');
         insert into inbox_leases (consumer, epoch, holder) values ('{consumer}', 1, 'pid 1')"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_consumers_role_neither_reads_nor_changes_another_consumers_rows() {
    let w = world().await;
    register(&w, &w.pool_a, w.config("iso_a")).await;
    register(&w, &w.pool_b, w.config("iso_b").ordered(true)).await;
    rows_for(&w.pool_a, "iso_a").await;
    rows_for(&w.pool_b, "iso_b").await;
    let before = w.rows_of("iso_b").await;
    assert!(
        before["lease"]["epoch"] == 1 && before["events"][0].is_object(),
        "{before}"
    );
    assert_eq!(before["registration"]["owner"], w.b.as_str(), "{before}");

    // A name whose owner role was dropped matches no session (and fails no
    // statement of the others).
    sqlx::query(
        "insert into inbox_consumers (consumer, stream, owner) values ('iso_gone', 'S', $1)",
    )
    .bind(format!("{}_dropped", w.a))
    .execute(&w.db.pool)
    .await
    .unwrap();

    let a = &w.pool_a;
    // Reads: nothing of iso_b, in any table; a's own rows, all there.
    for table in [
        "inbox_events",
        "inbox_dead_letters",
        "inbox_leases",
        "inbox_consumers",
    ] {
        let other = format!("select count(*) from {table} where consumer = 'iso_b'");
        assert_eq!(seen(a, &other).await, 0, "{table}");
        let all = format!("select count(*) from {table}");
        assert_eq!(seen(a, &all).await, 1, "{table}: a sees its own row only");
    }

    // Writes: each refused, or finding no row to change.
    let refused = "42501";
    let cases: [(&str, Result<u64, &str>); 15] = [
        // Make iso_b skip an event: insert its inbox row.
        (
            "insert into inbox_events (consumer, event_id, event_type, subject, event_time)
             values ('iso_b', gen_random_uuid(), 'iso.thing', 's', now())",
            Err(refused),
        ),
        // Apply one twice: delete its row.
        ("delete from inbox_events where consumer = 'iso_b'", Ok(0)),
        (
            "update inbox_events set handled_at = now() - interval '30 days'
              where consumer = 'iso_b'",
            Ok(0),
        ),
        (
            "insert into inbox_dead_letters
               (consumer, stream, stream_sequence, subject, delivery_count, reason, error, payload)
             values ('iso_b', 'S', 2, 'iso.thing', 1, 'rejected', 'no', '\\x00')",
            Err(refused),
        ),
        (
            "delete from inbox_dead_letters where consumer = 'iso_b'",
            Ok(0),
        ),
        (
            "update inbox_dead_letters set created_at = now() where consumer = 'iso_b'",
            Ok(0),
        ),
        // Stall its leader: bump the epoch, as a new leader does
        // (inbox-consumer/queries/lease_take.sql), or by hand.
        (
            "insert into inbox_leases (consumer, epoch, holder, acquired_at, released)
             values ('iso_b', 1, 'intruder', now(), false)
             on conflict (consumer) do update
                set epoch = inbox_leases.epoch + 1, holder = excluded.holder,
                    acquired_at = excluded.acquired_at, released = false",
            Err(refused),
        ),
        (
            "update inbox_leases set epoch = epoch + 1 where consumer = 'iso_b'",
            Ok(0),
        ),
        (
            "delete from inbox_leases where consumer = 'iso_b'",
            Err(refused),
        ),
        // Its registration: neither taken over, moved nor deleted.
        (
            "insert into inbox_consumers (consumer, stream) values ('iso_b', 'OTHER')
             on conflict (consumer) do nothing",
            Ok(0),
        ),
        (
            "insert into inbox_consumers (consumer, stream) values ('iso_b', 'OTHER')
             on conflict (consumer) do update set stream = excluded.stream",
            Err(refused),
        ),
        (
            "update inbox_consumers set ack_floor = 99 where consumer = 'iso_b'",
            Ok(0),
        ),
        (
            "update inbox_consumers set owner = current_user where consumer = 'iso_b'",
            Err(refused),
        ),
        (
            "delete from inbox_consumers where consumer = 'iso_b'",
            Err(refused),
        ),
        // Nor may it register a name for iso_b's role.
        (
            &format!(
                "insert into inbox_consumers (consumer, stream, owner) values ('iso_c', 'S', '{}')",
                w.b
            ),
            Err(refused),
        ),
    ];
    for (sql, expected) in cases {
        let got = try_sql(a, sql).await;
        assert_eq!(got, expected.map_err(str::to_owned), "{sql}");
    }
    // The one thing it may know of iso_b: who owns the name.
    let owner: String = sqlx::query_scalar("select inbox_consumer_owner('iso_b')::text")
        .fetch_one(a)
        .await
        .unwrap();
    assert_eq!(owner, w.b);

    assert_eq!(w.rows_of("iso_b").await, before, "iso_b's rows changed");
    // a's own rows are still a's to change (its retention, its epoch).
    assert_eq!(
        try_sql(
            a,
            "update inbox_leases set epoch = epoch + 1 where consumer = 'iso_a'"
        )
        .await,
        Ok(1)
    );
    assert_eq!(
        try_sql(a, "delete from inbox_events where consumer = 'iso_a'").await,
        Ok(1)
    );
    w.drop_roles().await;
}

// ---------------------------------------------------------------------------
// Running consumers.

/// Records each event it handles in `effects`, in the inbox transaction.
#[derive(Clone)]
struct Record {
    consumer: String,
}

impl Handler for Record {
    type Message = Value;

    async fn handle(
        &self,
        event: Envelope<Value>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        sqlx::query("insert into effects (consumer, event_id) values ($1, $2)")
            .bind(&self.consumer)
            .bind(event.id().as_uuid())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

struct Running {
    stop: oneshot::Sender<()>,
    task: JoinHandle<inbox_consumer::Result<()>>,
}

impl Running {
    async fn shutdown(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("graceful shutdown finishes")
            .unwrap()
            .unwrap();
    }
}

/// Starts `config`'s consumer under `pool`'s role, one delivery per
/// transaction or (`batched`) several.
async fn start(w: &World, pool: &PgPool, config: ConsumerConfig, batched: bool) -> Running {
    let durable = config.durable().to_owned();
    let consumer = Consumer::new(pool.clone(), w.js.clone(), config)
        .await
        .unwrap_or_else(|e| panic!("{durable}: {e}"));
    let stack = ServiceBuilder::new()
        .layer(DedupeLayer::new(pool.clone()))
        .service(Router::new().route(TYPE, HandlerService::new(Record { consumer: durable })));
    let (stop, stopped) = oneshot::channel::<()>();
    let shutdown = async {
        let _ = stopped.await;
    };
    let task = if batched {
        tokio::spawn(consumer.run_batched(stack, shutdown))
    } else {
        tokio::spawn(consumer.run(stack, shutdown))
    };
    Running { stop, task }
}

async fn wait_handled(w: &World, consumer: &str, n: i64) {
    let handled = wait_until(&format!("{consumer} handles {n} events"), WAIT, || async {
        w.count(
            "select count(*) from inbox_events where consumer = $1",
            consumer,
        )
        .await
            == n
            && w.count("select count(*) from effects where consumer = $1", consumer)
                .await
                == n
    })
    .await;
    if let Err(e) = handled {
        panic!("{e}\n{}", log());
    }
}

#[tokio::test]
async fn consumers_run_under_their_own_roles_and_a_name_owned_by_another_is_refused() {
    let w = world().await;
    let ordered = start(&w, &w.pool_a, w.config("iso_a").ordered(true), false).await;
    let batched = start(&w, &w.pool_b, w.config("iso_b").max_batch(8), true).await;
    w.publish(20).await;
    wait_handled(&w, "iso_a", 20).await;
    wait_handled(&w, "iso_b", 20).await;
    // The ordered one led under its own role: its epoch bump went through.
    assert_eq!(
        w.count(
            "select count(*) from inbox_leases where consumer = $1",
            "iso_a"
        )
        .await,
        1
    );
    assert_eq!(
        w.count(
            "select count(*) from inbox_dead_letters where consumer like $1",
            "iso_%"
        )
        .await,
        0
    );

    // Each name under the other's role: refused at start, naming the
    // consumer, its owner and the role, before anything is created.
    for (pool, durable, owner, role, ordered) in [
        (&w.pool_b, "iso_a", &w.a, &w.b, true),
        (&w.pool_a, "iso_b", &w.b, &w.a, false),
    ] {
        let err = Consumer::new(
            pool.clone(),
            w.js.clone(),
            w.config(durable).ordered(ordered),
        )
        .await
        .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Privilege, "{err}");
        let text = err.to_string();
        for needle in [
            format!("consumer `{durable}`"),
            format!("owned by role `{owner}`"),
            format!("role `{role}` is not a member"),
        ] {
            assert!(text.contains(&needle), "{needle}: {text}");
        }
    }
    // The refused starts changed nothing: both go on.
    w.publish(5).await;
    wait_handled(&w, "iso_a", 25).await;
    wait_handled(&w, "iso_b", 25).await;

    // iso_b's name handed to a's role while b's runtime runs: each of its
    // batches is refused, loudly, and nothing is dead-lettered; handed back,
    // the events are handled.
    let hand_to = |role: &str| {
        format!("update inbox_consumers set owner = '{role}' where consumer = 'iso_b'")
    };
    sqlx::query(sqlx::AssertSqlSafe(hand_to(&w.a)))
        .execute(&w.db.pool)
        .await
        .unwrap();
    w.publish(5).await;
    let refused = wait_until("iso_b's refused batches logged", WAIT, || async {
        log().lines().any(|l| {
            l.contains("ERROR")
                && l.contains("consumer=iso_b")
                && l.contains("lacks a privilege")
                && l.contains("row-level security")
        })
    })
    .await;
    if let Err(e) = refused {
        panic!("{e}\n{}", log());
    }
    sqlx::query(sqlx::AssertSqlSafe(hand_to(&w.b)))
        .execute(&w.db.pool)
        .await
        .unwrap();
    wait_handled(&w, "iso_a", 30).await;
    wait_handled(&w, "iso_b", 30).await;
    assert_eq!(
        w.count(
            "select count(*) from inbox_dead_letters where consumer like $1",
            "iso_%"
        )
        .await,
        0
    );
    ordered.shutdown().await;
    batched.shutdown().await;
    w.drop_roles().await;
}

#[tokio::test]
async fn a_foreign_holder_of_a_leader_lock_is_named_by_the_standby() {
    let w = world().await;
    register(&w, &w.pool_a, w.config("iso_lock").ordered(true)).await;
    // b's session takes iso_lock's leader lock
    // (inbox-consumer/queries/lease_try_lock.sql, in `public`).
    let mut intruder = sqlx::PgConnection::connect(&as_user(w.db.url(), &w.b))
        .await
        .unwrap();
    let pid: i32 = sqlx::query_scalar(
        "select pg_backend_pid() from
           (select pg_advisory_lock(hashtext('inbox_consumer.leader'), hashtext('iso_lock'))) l",
    )
    .fetch_one(&mut intruder)
    .await
    .unwrap();

    let standby = start(&w, &w.pool_a, w.config("iso_lock").ordered(true), false).await;
    let named = format!("session {pid} of role `{}`", w.b);
    let reported = wait_until("the standby names the lock's holder", WAIT, || async {
        log()
            .lines()
            .any(|l| l.contains("ERROR") && l.contains("consumer `iso_lock`") && l.contains(&named))
    })
    .await;
    if let Err(e) = reported {
        panic!("{e}\n{}", log());
    }
    let line = log()
        .lines()
        .find(|l| l.contains(&named))
        .unwrap()
        .to_owned();
    assert!(
        line.contains(&format!("its owner is `{}`", w.a))
            && line.contains(&format!("pg_terminate_backend({pid})")),
        "{line}"
    );
    w.publish(3).await;
    assert_eq!(
        w.count(
            "select count(*) from effects where consumer = $1",
            "iso_lock"
        )
        .await,
        0,
        "nothing handled while the lock is held"
    );

    // Once the intruder's session ends, the standby leads.
    intruder.close().await.unwrap();
    wait_handled(&w, "iso_lock", 3).await;
    standby.shutdown().await;
    w.drop_roles().await;
}
