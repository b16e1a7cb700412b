//! Several outboxes in one database, one per schema (a tenant each), as the
//! relay guide's "Another schema" (docs/relay.md) sets them up: relays,
//! wake-ups and ordered consumers of one schema never see another's
//! (outbox_pg::Namespace).

use std::collections::HashMap;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use inbox_consumer::{
    Consumer, ConsumerConfig, DedupeLayer, Handler, HandlerError, HandlerService, RetryPolicy,
    Router,
};
use outbox_pg::{Envelope, Namespace};
use outbox_testkit::{Program, TestDb, wait_until};

use super::{unpublished, write};
use serde_json::{Value, json};
use sqlx::postgres::PgListener;
use sqlx::{PgPool, PgTransaction};
use tower::ServiceBuilder;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// `url` with `schema` first on the search_path, as docs/relay.md ("Another schema") says.
fn in_schema(url: &str, schema: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options=-csearch_path%3D{schema}")
}

/// Creates `schema` and migrates an outbox into it; its pool.
async fn tenant(db: &TestDb, schema: &str) -> PgPool {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("create schema \"{schema}\"")))
        .execute(&db.pool)
        .await
        .unwrap();
    let pool = PgPool::connect(&in_schema(db.url(), schema)).await.unwrap();
    outbox_pg::migrate(&pool).await.unwrap();
    pool
}

/// Exclusive shard locks held under `key` (pg_locks shows it unsigned).
async fn shard_locks(pool: &PgPool, key: i32) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_locks
          where locktype = 'advisory' and objsubid = 2 and granted and mode = 'ExclusiveLock'
            and database = (select oid from pg_database where datname = current_database())
            and classid::text::bigint = ($1::int::bigint & 4294967295)",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Every message of `stream` in stream order: (id, subject).
async fn read_stream(js: &jetstream::Context, stream: &str) -> Vec<(Uuid, String)> {
    let mut stream = js.get_stream(stream).await.unwrap();
    let total = usize::try_from(stream.info().await.unwrap().state.messages).unwrap();
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::with_capacity(total);
    while out.len() < total {
        let message = tokio::time::timeout(WAIT, messages.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let body: Value = serde_json::from_slice(&message.payload).unwrap();
        let id = Uuid::parse_str(body["id"].as_str().unwrap()).unwrap();
        out.push((id, body["subject"].as_str().unwrap().to_owned()));
    }
    out
}

/// Each row of the table published once, and each subject's rows stored in
/// seq order.
async fn assert_once_in_order(pool: &PgPool, stored: &[(Uuid, String)]) {
    let rows: Vec<(Uuid, String)> =
        sqlx::query_as("select id, subject from outbox_events order by seq")
            .fetch_all(pool)
            .await
            .unwrap();
    let mut expected: HashMap<&str, Vec<Uuid>> = HashMap::new();
    for (id, subject) in &rows {
        expected.entry(subject).or_default().push(*id);
    }
    let mut seen: HashMap<&str, Vec<Uuid>> = HashMap::new();
    for (id, subject) in stored {
        seen.entry(subject).or_default().push(*id);
    }
    assert_eq!(stored.len(), rows.len(), "each row stored once");
    assert_eq!(
        seen, expected,
        "per subject, the stream holds the rows in seq order"
    );
}

/// Two tenants in two schemas of one database, an `outbox-relay` each with
/// its own search_path and stream, rows written to both while both run:
/// every row of both is published once and in order, and each relay holds
/// all 64 shards of its own outbox.
#[tokio::test]
async fn two_schemas_a_relay_each_publish_every_row_once_in_order() {
    two_schemas_a_relay_each(&[]).await;
}

/// The same with `--source wal`: each relay leads its own schema's source
/// (neither stands by behind the other) through a slot and publication of
/// its own, and reads only its own schema's rows from the one WAL.
#[tokio::test]
async fn two_schemas_a_wal_relay_each_publish_every_row_once_in_order() {
    two_schemas_a_relay_each(&["--source", "wal"]).await;
}

async fn two_schemas_a_relay_each(source: &[&str]) {
    let wal = !source.is_empty();
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let unique = &db.name()[db.name().len() - 8..];
    let log_dir = std::env::temp_dir().join("tenant-tests").join(db.name());
    std::fs::create_dir_all(&log_dir).unwrap();

    let (a, b) = tokio::join!(tenant(&db, "tenant_a"), tenant(&db, "tenant_b"));
    let mut relays = Vec::new();
    for (schema, prefix) in [("tenant_a", "ta"), ("tenant_b", "tb")] {
        let mut relay = Program::new(
            &format!("relay-{schema}"),
            super::support::bin_dir().join("outbox-relay"),
            &log_dir,
        )
        .env("DATABASE_URL", in_schema(db.url(), schema))
        .env("NATS_URL", nats.url())
        .args(["--stream", &format!("{prefix}_{unique}")])
        .args(["--subjects", &format!("{prefix}.>")])
        .args(source.iter().copied());
        relay.start().await.unwrap();
        relays.push(relay);
    }
    let log = |name: &str| {
        std::fs::read_to_string(log_dir.join(format!("relay-{name}.log"))).unwrap_or_default()
    };

    if wal {
        for schema in ["tenant_a", "tenant_b"] {
            wait_until("the relay reads the WAL", WAIT, || async {
                log(schema).contains("reading the WAL")
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", log(schema)));
        }
    }
    for _ in 0..16 {
        tokio::join!(write(&a, "ta.step", 20, 100), write(&b, "tb.step", 20, 100));
    }
    let done = wait_until("both outboxes drained", WAIT, || async {
        unpublished(&a).await == 0 && unpublished(&b).await == 0
    })
    .await;
    if let Err(e) = done {
        panic!(
            "{e}: {} and {} rows unpublished\n--- tenant_a:\n{}\n--- tenant_b:\n{}",
            unpublished(&a).await,
            unpublished(&b).await,
            log("tenant_a"),
            log("tenant_b")
        );
    }

    let na = Namespace::of_table(&a, "outbox_events")
        .await
        .unwrap()
        .unwrap();
    let nb = Namespace::of_table(&b, "outbox_events")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (na.schema(), nb.schema()),
        ("tenant_a", "tenant_b"),
        "each pool finds its own table"
    );
    assert_ne!(na.relay_shards_key(), nb.relay_shards_key());
    assert_ne!(na.relay_members_key(), nb.relay_members_key());
    if wal {
        for schema in ["tenant_a", "tenant_b"] {
            assert!(log(schema).contains("reading the WAL"), "{}", log(schema));
        }
        let slots: Vec<String> = sqlx::query_scalar(
            "select slot_name::text from pg_replication_slots
              where database = current_database() and active order by 1",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap();
        assert_eq!(slots.len(), 2, "a slot each, both read: {slots:?}");
    } else {
        assert_eq!(shard_locks(&a, na.relay_shards_key()).await, 64);
        assert_eq!(shard_locks(&a, nb.relay_shards_key()).await, 64);
    }

    for (pool, prefix) in [(&a, "ta"), (&b, "tb")] {
        let stored = read_stream(&js, &format!("{prefix}_{unique}")).await;
        assert_once_in_order(pool, &stored).await;
    }
    for relay in &mut relays {
        assert_eq!(relay.terminate().await, Some(0));
    }
    if wal {
        super::support::wal::drop_slots(&db.pool).await;
    }
    let _ = std::fs::remove_dir_all(&log_dir);
}

/// The insert trigger of an outbox in a schema notifies the channel the
/// relay listens on for that schema, also for a schema name too long to fit
/// a channel name whole.
#[tokio::test]
async fn each_schema_notifies_the_channel_its_relay_listens_on() {
    let db = TestDb::new().await.unwrap();
    let long = format!("tenant_{}", "x".repeat(52));
    for schema in ["tenant_n", long.as_str()] {
        let pool = tenant(&db, schema).await;
        let namespace = Namespace::of_table(&pool, "outbox_events")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(namespace.schema(), schema);
        assert!(namespace.notify_channel().len() <= 63);
        assert_ne!(namespace.notify_channel(), outbox_publisher::NOTIFY_CHANNEL);
        let mut listener = PgListener::connect_with(&pool).await.unwrap();
        listener.listen(namespace.notify_channel()).await.unwrap();
        write(&pool, "tn.step", 1, 1).await;
        let received = tokio::time::timeout(WAIT, listener.recv())
            .await
            .expect("a notification on the schema's channel")
            .unwrap();
        assert_eq!(received.channel(), namespace.notify_channel());

        // Scheduling rows notifies the schema's due channel, and only it.
        assert!(namespace.due_channel().len() <= 63);
        assert_ne!(namespace.due_channel(), "outbox_events_due");
        let mut due = PgListener::connect_with(&pool).await.unwrap();
        due.listen(namespace.due_channel()).await.unwrap();
        let mut tx = pool.begin().await.unwrap();
        let event =
            outbox_pg::Envelope::new("tn.step", "tenants", "e-1", serde_json::json!({})).unwrap();
        outbox_pg::Outbox::unvalidated()
            .schedule(
                &mut tx,
                &event,
                outbox_pg::Due::In(Duration::from_secs(3600)),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let received = tokio::time::timeout(WAIT, due.recv())
            .await
            .expect("a notification on the schema's due channel")
            .unwrap();
        assert_eq!(received.channel(), namespace.due_channel());
    }
    // `public` keeps the channel it always had.
    outbox_pg::migrate(&db.pool).await.unwrap();
    let public = Namespace::of_table(&db.pool, "outbox_events")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(public.notify_channel(), outbox_publisher::NOTIFY_CHANNEL);
    assert_eq!(public.due_channel(), "outbox_events_due");
}

/// Records each event applied, in the schema the consumer's pool reaches.
#[derive(Clone)]
struct Record;

impl Handler for Record {
    type Message = Value;

    async fn handle(
        &self,
        event: Envelope<Value>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        sqlx::query("insert into effects (subject, n) values ($1, ($2::jsonb ->> 'n')::bigint)")
            .bind(event.subject())
            .bind(event.data())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Two ordered consumers under one durable name, on two streams, their
/// inboxes in two schemas of one database: both lead at once (their
/// leadership locks are their schemas' own) and apply every event once, in
/// order.
#[tokio::test]
async fn ordered_consumers_of_one_name_in_two_schemas_both_lead() {
    let db = TestDb::new().await.unwrap();
    let nats = outbox_testkit::nats().unwrap();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let unique = &db.name()[db.name().len() - 8..];
    let mut running = Vec::new();
    let mut pools = Vec::new();
    for (schema, prefix) in [("tenant_c", "tc"), ("tenant_d", "td")] {
        let pool = tenant(&db, schema).await;
        sqlx::query(
            "create table effects (k bigserial primary key, subject text not null, n bigint not null)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let stream = format!("{prefix}_{unique}");
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
        let config = ConsumerConfig::new(&stream, "billing")
            .ordered(true)
            .lease_timeout(Duration::from_secs(6))
            .ack_wait(Duration::from_secs(3))
            .retry(RetryPolicy::default().base(Duration::from_millis(50)));
        let consumer = Consumer::new(pool.clone(), js.clone(), config)
            .await
            .unwrap();
        let service = ServiceBuilder::new()
            .layer(DedupeLayer::new(pool.clone()))
            .service(Router::new().route(&format!("{prefix}.step"), HandlerService::new(Record)));
        let stop = tokio_util::sync::CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(consumer.run(service, async move { stopped.cancelled().await }));
        running.push((stop, task));
        for n in 0..40 {
            let event = Envelope::new(
                format!("{prefix}.step"),
                "tests",
                format!("sub_{}", n % 4),
                json!({"n": n}),
            )
            .unwrap();
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", event.id().to_string().as_str());
            js.publish_with_headers(
                event.event_type().as_str().to_owned(),
                headers,
                event.to_json().unwrap().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
        pools.push(pool);
    }
    for pool in &pools {
        wait_until("every event applied in both schemas", WAIT, || async {
            sqlx::query_scalar::<_, i64>("select count(*) from effects")
                .fetch_one(pool)
                .await
                .unwrap()
                == 40
        })
        .await
        .unwrap();
        let by_subject: Vec<(String, Vec<i64>)> = sqlx::query_as(
            "select subject, array_agg(n order by k) from effects group by subject order by subject",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        for (subject, ns) in by_subject {
            let mut sorted = ns.clone();
            sorted.sort_unstable();
            assert_eq!(ns, sorted, "{subject} applied in order");
            assert_eq!(ns.len(), 10, "{subject} applied once each");
        }
        let epoch: i64 =
            sqlx::query_scalar("select epoch from inbox_leases where consumer = 'billing'")
                .fetch_one(pool)
                .await
                .unwrap();
        assert_eq!(epoch, 1, "one leader, never deposed");
    }
    for (stop, task) in running {
        stop.cancel();
        tokio::time::timeout(WAIT, task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}
