//! outbox-pg against a real PostgreSQL: the transactional write, validation,
//! batch inserts and the migrated schema.

mod support;

use outbox_pg::{Envelope, ErrorKind, Outbox, SchemaRegistry};
use outbox_testkit::TestDb;
use serde_json::{Value, json};
use sqlx::Row;

fn schemas_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../schemas/events")
}

fn outbox() -> Outbox {
    Outbox::new(SchemaRegistry::from_dir(schemas_dir()).unwrap())
}

fn created(sub: &str) -> Envelope<Value> {
    Envelope::new(
        "subscription.created",
        "subscriptions",
        sub,
        json!({"subscription_id": sub, "customer_id": "c1", "plan": "pro", "amount_cents": 1234}),
    )
    .unwrap()
}

async fn business_table(db: &TestDb) {
    sqlx::query("create table subscriptions (id text primary key, plan text not null)")
        .execute(&db.pool)
        .await
        .unwrap();
}

#[tokio::test]
async fn commit_writes_row_and_event_together() {
    let db = TestDb::new().await.unwrap();
    business_table(&db).await;
    let outbox = outbox();

    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("insert into subscriptions values ('sub_1', 'pro')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let event = created("sub_1");
    let id = outbox.enqueue(&mut tx, &event).await.unwrap();
    assert_eq!(id, event.id());
    tx.commit().await.unwrap();

    assert_eq!(
        support::count(&db.pool, "select count(*) from subscriptions").await,
        1
    );
    let row = sqlx::query(
        "select id, event_type, source, subject, time, data, created_at, published_at, attempts
           from outbox_events",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(row.get::<uuid::Uuid, _>("id"), *id.as_uuid());
    assert_eq!(row.get::<String, _>("event_type"), "subscription.created");
    assert_eq!(row.get::<String, _>("source"), "subscriptions");
    assert_eq!(row.get::<String, _>("subject"), "sub_1");
    assert_eq!(
        row.get::<chrono::DateTime<chrono::Utc>, _>("time"),
        event.time()
    );
    assert_eq!(row.get::<Value, _>("data"), *event.data());
    assert!(
        row.get::<Option<chrono::DateTime<chrono::Utc>>, _>("published_at")
            .is_none()
    );
    assert_eq!(row.get::<i32, _>("attempts"), 0);
}

#[tokio::test]
async fn rollback_leaves_neither_row_nor_event() {
    let db = TestDb::new().await.unwrap();
    business_table(&db).await;
    let outbox = outbox();

    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("insert into subscriptions values ('sub_1', 'pro')")
        .execute(&mut *tx)
        .await
        .unwrap();
    outbox.enqueue(&mut tx, &created("sub_1")).await.unwrap();
    tx.rollback().await.unwrap();

    assert_eq!(
        support::count(&db.pool, "select count(*) from subscriptions").await,
        0
    );
    assert_eq!(
        support::count(&db.pool, "select count(*) from outbox_events").await,
        0
    );

    // Dropping the transaction without commit is a rollback too.
    {
        let mut tx = db.pool.begin().await.unwrap();
        outbox.enqueue(&mut tx, &created("sub_2")).await.unwrap();
    }
    assert_eq!(
        support::count(&db.pool, "select count(*) from outbox_events").await,
        0
    );
}

#[tokio::test]
async fn schema_violation_is_named_and_writes_nothing() {
    let db = TestDb::new().await.unwrap();
    let outbox = outbox();
    let bad = Envelope::new(
        "subscription.created",
        "subscriptions",
        "sub_1",
        json!({"subscription_id": "sub_1", "customer_id": "c1", "plan": "pro", "amount_cents": "12"}),
    )
    .unwrap();

    let mut tx = db.pool.begin().await.unwrap();
    let err = outbox.enqueue(&mut tx, &bad).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::SchemaViolation);
    assert_eq!(err.event_type(), Some("subscription.created"));
    assert_eq!(err.violations()[0].instance_path, "/amount_cents");
    let msg = err.to_string();
    assert!(
        msg.contains("subscription.created")
            && msg.contains("/amount_cents")
            && msg.contains("integer"),
        "{msg}"
    );
    // The transaction is still usable: validation happens before any statement.
    sqlx::query("select 1").execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        support::count(&db.pool, "select count(*) from outbox_events").await,
        0
    );
}

#[tokio::test]
async fn unknown_event_type_is_named() {
    let db = TestDb::new().await.unwrap();
    let outbox = outbox();
    let unknown = Envelope::new("subscription.exploded", "subscriptions", "s", json!({})).unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let err = outbox.enqueue(&mut tx, &unknown).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UnknownEventType);
    assert!(err.to_string().contains("subscription.exploded"), "{err}");
    tx.commit().await.unwrap();
    assert_eq!(
        support::count(&db.pool, "select count(*) from outbox_events").await,
        0
    );
}

#[tokio::test]
async fn a_batch_with_one_invalid_event_writes_none() {
    let db = TestDb::new().await.unwrap();
    let outbox = outbox();
    let mut events: Vec<_> = (0..10).map(|i| created(&format!("sub_{i}"))).collect();
    events.push(Envelope::new("subscription.created", "s", "x", json!({"plan": ""})).unwrap());
    let mut tx = db.pool.begin().await.unwrap();
    let err = outbox.enqueue_all(&mut tx, &events).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::SchemaViolation);
    tx.commit().await.unwrap();
    assert_eq!(
        support::count(&db.pool, "select count(*) from outbox_events").await,
        0
    );
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Enqueues `events` in a transaction, expects a refusal of `kind`, then shows
/// the transaction is still usable (no statement was sent), commits it, and
/// checks that nothing was written. Returns the error message.
async fn refused_and_nothing_written(
    db: &TestDb,
    outbox: &Outbox,
    events: &[Envelope<Value>],
    kind: ErrorKind,
) -> String {
    let mut tx = db.pool.begin().await.unwrap();
    let err = outbox.enqueue_all(&mut tx, events).await.unwrap_err();
    assert_eq!(err.kind(), kind, "{err}");
    sqlx::query("select 1").execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        support::count(&db.pool, "select count(*) from outbox_events").await,
        0
    );
    err.to_string()
}

#[tokio::test]
async fn header_unsafe_trace_context_is_refused_and_writes_nothing() {
    let db = TestDb::new().await.unwrap();
    let outbox = outbox();
    let cases = [
        (format!("{TRACEPARENT}\n"), None, "traceparent", r"\n"),
        (
            "00-4bf92f3577b34da6\r\nX-Injected: 1".to_owned(),
            None,
            "traceparent",
            r"\r\n",
        ),
        (
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
            None,
            "traceparent",
            "version `ff`",
        ),
        (
            TRACEPARENT.to_owned(),
            Some("rojo=1\r\nX-Injected: 1"),
            "tracestate",
            r"'\r'",
        ),
        (
            TRACEPARENT.to_owned(),
            Some("rojo=caf\u{e9}"),
            "tracestate",
            "printable ASCII",
        ),
    ];
    for (traceparent, tracestate, attribute, reason) in cases {
        let bad = created("sub_1").with_trace_context(traceparent, tracestate.map(str::to_owned));
        let msg =
            refused_and_nothing_written(&db, &outbox, &[bad], ErrorKind::InvalidEnvelope).await;
        assert!(
            msg.contains(attribute) && msg.contains(reason) && msg.contains("subscription.created"),
            "{msg}"
        );
        assert!(!msg.contains('\n') && !msg.contains('\r'), "{msg:?}");
    }

    // Well-formed trace context is written as given.
    let good = created("sub_1").with_trace_context(
        TRACEPARENT.to_owned(),
        Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE".to_owned()),
    );
    let mut tx = db.pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, &good).await.unwrap();
    tx.commit().await.unwrap();
    let (tp, ts): (Option<String>, Option<String>) =
        sqlx::query_as("select traceparent, tracestate from outbox_events")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(tp.as_deref(), good.traceparent());
    assert_eq!(ts.as_deref(), good.tracestate());
}

#[tokio::test]
async fn reserved_nats_namespaces_cannot_reach_the_outbox() {
    let db = TestDb::new().await.unwrap();
    for reserved in ["$JS.API.STREAM.DELETE.X", "$SYS.x", "_INBOX.abc"] {
        let err = Envelope::new(reserved, "subscriptions", "sub_1", json!({})).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidEnvelope);
        assert!(err.to_string().contains("reserved namespace"), "{err}");

        // A row another client inserted with such a type is refused when the
        // relay builds its envelope.
        let id = uuid::Uuid::now_v7();
        sqlx::query(
            "insert into outbox_events (id, event_type, source, subject, time, data)
             values ($1, $2, 'php-service', 'sub_1', now(), '{}')",
        )
        .bind(id)
        .bind(reserved)
        .execute(&db.pool)
        .await
        .unwrap();
        let (event_type, time): (String, chrono::DateTime<chrono::Utc>) =
            sqlx::query_as("select event_type, time from outbox_events where id = $1")
                .bind(id)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        let err = Envelope::from_parts(
            outbox_pg::EventId::from_uuid(id),
            event_type,
            "php-service",
            "sub_1",
            time,
            json!({}),
        )
        .unwrap_err();
        assert!(err.to_string().contains("reserved namespace"), "{err}");
    }
}

#[tokio::test]
async fn a_time_beyond_year_9999_is_refused_and_writes_nothing() {
    use chrono::TimeZone;
    let db = TestDb::new().await.unwrap();
    let time = chrono::Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap();
    let msg = refused_and_nothing_written(
        &db,
        &outbox(),
        &[created("sub_1").with_time(time)],
        ErrorKind::InvalidEnvelope,
    )
    .await;
    assert!(msg.contains("time") && msg.contains("year 10000"), "{msg}");
}

#[tokio::test]
async fn data_nested_too_deep_is_refused_and_writes_nothing() {
    let db = TestDb::new().await.unwrap();
    let deep = (0..200).fold(json!(1), |inner, _| json!([inner]));
    let event = Envelope::new("subscription.created", "subscriptions", "sub_1", deep).unwrap();
    let msg = refused_and_nothing_written(
        &db,
        &Outbox::unvalidated(),
        &[event],
        ErrorKind::InvalidEnvelope,
    )
    .await;
    assert!(
        msg.contains("data") && msg.contains("nested deeper"),
        "{msg}"
    );
}

#[tokio::test]
async fn a_message_over_the_limit_is_too_large_and_writes_nothing() {
    let db = TestDb::new().await.unwrap();
    let big = Envelope::new(
        "subscription.created",
        "subscriptions",
        "sub_1",
        json!({"blob": "x".repeat(outbox_pg::DEFAULT_MAX_MESSAGE_SIZE)}),
    )
    .unwrap();
    let size = big.message_size().unwrap();
    let msg =
        refused_and_nothing_written(&db, &Outbox::unvalidated(), &[big], ErrorKind::TooLarge).await;
    assert!(
        msg.contains("subscription.created")
            && msg.contains(&format!("{size} bytes"))
            && msg.contains("limit of 1048576 bytes"),
        "{msg}"
    );

    // The limit is configurable, and inclusive.
    let event = created("sub_1");
    let size = event.message_size().unwrap();
    let msg = refused_and_nothing_written(
        &db,
        &outbox().max_message_size(size - 1),
        std::slice::from_ref(&event),
        ErrorKind::TooLarge,
    )
    .await;
    assert!(
        msg.contains(&format!("limit of {} bytes", size - 1)),
        "{msg}"
    );
    let mut tx = db.pool.begin().await.unwrap();
    outbox()
        .max_message_size(size)
        .enqueue(&mut tx, &event)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        support::count(&db.pool, "select count(*) from outbox_events").await,
        1
    );
}

#[tokio::test]
async fn a_batch_with_one_unpublishable_event_writes_none() {
    use chrono::TimeZone;
    let db = TestDb::new().await.unwrap();
    let outbox = outbox().max_message_size(64 * 1024);
    let good = || {
        (0..10)
            .map(|i| created(&format!("sub_{i}")))
            .collect::<Vec<_>>()
    };
    let far_future = chrono::Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap();
    let bad = [
        (
            created("bad").with_trace_context(format!("{TRACEPARENT}\n"), None),
            ErrorKind::InvalidEnvelope,
        ),
        (
            created("bad").with_trace_context(TRACEPARENT.into(), Some("k=v\r\n".into())),
            ErrorKind::InvalidEnvelope,
        ),
        (created("bad").with_time(far_future), ErrorKind::InvalidEnvelope),
        (
            Envelope::new(
                "subscription.created",
                "subscriptions",
                "bad",
                json!({"subscription_id": "x".repeat(70_000), "customer_id": "c1", "plan": "pro", "amount_cents": 1}),
            )
            .unwrap(),
            ErrorKind::TooLarge,
        ),
    ];
    for (bad, kind) in bad {
        let mut events = good();
        events.insert(5, bad);
        refused_and_nothing_written(&db, &outbox, &events, kind).await;
    }
}

#[tokio::test]
async fn thousand_events_in_one_statement() {
    let db = TestDb::new().await.unwrap();
    // Count INSERT statements on outbox_events with a statement-level trigger.
    sqlx::raw_sql(
        "create table insert_statements (n int not null);
         insert into insert_statements values (0);
         create function count_insert_statement() returns trigger language plpgsql as $$
           begin update insert_statements set n = n + 1; return null; end $$;
         create trigger count_insert_statement after insert on outbox_events
           for each statement execute function count_insert_statement();",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let outbox = outbox();
    let events: Vec<_> = (0..1000).map(|i| created(&format!("sub_{i}"))).collect();

    let mut tx = db.pool.begin().await.unwrap();
    let ids = outbox.enqueue_all(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();

    assert_eq!(
        ids,
        events.iter().map(Envelope::id).collect::<Vec<_>>(),
        "ids returned in input order"
    );
    assert_eq!(
        support::count(&db.pool, "select n::bigint from insert_statements").await,
        1,
        "INSERT statements issued for 1,000 events"
    );
    assert_eq!(
        support::count(&db.pool, "select count(*) from outbox_events").await,
        1000
    );
    let stored: Vec<uuid::Uuid> = sqlx::query_scalar("select id from outbox_events order by id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let mut expected: Vec<uuid::Uuid> = ids.iter().map(|i| *i.as_uuid()).collect();
    expected.sort();
    assert_eq!(stored, expected);
}

#[tokio::test]
async fn migrated_table_matches_the_contract() {
    let db = TestDb::new().await.unwrap();
    let columns: Vec<(String, String, String, Option<String>)> = sqlx::query_as(
        "select column_name::text, data_type::text, is_nullable::text, column_default::text
           from information_schema.columns
          where table_schema = current_schema() and table_name = 'outbox_events'
          order by ordinal_position",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let contract = [
        ("id", "uuid", "NO"),
        ("event_type", "text", "NO"),
        ("source", "text", "NO"),
        ("subject", "text", "NO"),
        ("time", "timestamp with time zone", "NO"),
        ("data", "jsonb", "NO"),
        ("created_at", "timestamp with time zone", "NO"),
        ("published_at", "timestamp with time zone", "YES"),
        ("attempts", "integer", "NO"),
    ];
    // Documented extensions: nullable or filled by the database (seq by a
    // trigger, shard generated), so writers in any language may ignore them.
    let extensions = [
        ("next_attempt_at", "timestamp with time zone", "YES"),
        ("locked_until", "timestamp with time zone", "YES"),
        ("last_error", "text", "YES"),
        ("traceparent", "text", "YES"),
        ("tracestate", "text", "YES"),
        ("seq", "bigint", "NO"),
        ("shard", "smallint", "YES"),
        ("skipped_at", "timestamp with time zone", "YES"),
        ("skipped_by", "text", "YES"),
        ("skip_reason", "text", "YES"),
        ("published_stream", "text", "YES"),
        ("published_seq", "bigint", "YES"),
        ("due_at", "timestamp with time zone", "YES"),
        ("released_at", "timestamp with time zone", "YES"),
        ("cancelled_at", "timestamp with time zone", "YES"),
        ("cancelled_by", "text", "YES"),
    ];
    let expected: Vec<(&str, &str, &str)> = contract.iter().chain(&extensions).copied().collect();
    let actual: Vec<(&str, &str, &str)> = columns
        .iter()
        .map(|(n, t, nl, _)| (n.as_str(), t.as_str(), nl.as_str()))
        .collect();
    assert_eq!(actual, expected);
    let default_of = |name: &str| {
        columns
            .iter()
            .find(|c| c.0 == name)
            .and_then(|c| c.3.clone())
            .unwrap_or_default()
    };
    assert_eq!(default_of("created_at"), "now()");
    assert_eq!(default_of("attempts"), "0");

    let pk: String = sqlx::query_scalar(
        "select a.attname::text from pg_index i
           join pg_attribute a on a.attrelid = i.indrelid and a.attnum = any(i.indkey)
          where i.indrelid = 'outbox_events'::regclass and i.indisprimary",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(pk, "id");

    let index: String = sqlx::query_scalar(
        "select indexdef from pg_indexes where indexname = 'outbox_events_unpublished_idx'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        index.contains("(created_at)") && index.contains("WHERE (published_at IS NULL)"),
        "{index}"
    );
}

#[tokio::test]
async fn inbox_table_has_its_unique_key_and_indexes() {
    let db = TestDb::new().await.unwrap();
    let columns: Vec<String> = sqlx::query_scalar(
        "select column_name::text from information_schema.columns
          where table_schema = current_schema() and table_name = 'inbox_events'
          order by ordinal_position",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        columns,
        [
            "consumer",
            "event_id",
            "event_type",
            "subject",
            "event_time",
            "handled_at",
            "sequence"
        ]
    );
    let insert = "insert into inbox_events (consumer, event_id, event_type, subject, event_time)
                  values ($1, $2, 'a.b', 's', now()) on conflict do nothing";
    let id = uuid::Uuid::now_v7();
    let first = sqlx::query(insert)
        .bind("billing")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    let again = sqlx::query(insert)
        .bind("billing")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    let other = sqlx::query(insert)
        .bind("audit")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        (
            first.rows_affected(),
            again.rows_affected(),
            other.rows_affected()
        ),
        (1, 0, 1)
    );
    let indexes: Vec<String> = sqlx::query_scalar(
        "select indexname::text from pg_indexes where tablename = 'inbox_events' order by 1",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(indexes.contains(&"inbox_events_handled_at_idx".to_string()));
    assert!(indexes.contains(&"inbox_events_subject_time_idx".to_string()));
}

#[tokio::test]
async fn events_written_by_another_client_round_trip_through_the_envelope() {
    // A writer in another language inserts with plain SQL; the row decodes into
    // the same envelope the relay will publish.
    let db = TestDb::new().await.unwrap();
    let id = uuid::Uuid::now_v7();
    sqlx::query(
        "insert into outbox_events (id, event_type, source, subject, time, data)
         values ($1, 'subscription.created', 'php-service', 'sub_9', now(), '{\"plan\":\"pro\"}')",
    )
    .bind(id)
    .execute(&db.pool)
    .await
    .unwrap();
    let (event_type, source, subject, time, data): (
        String,
        String,
        String,
        chrono::DateTime<chrono::Utc>,
        Value,
    ) = sqlx::query_as("select event_type, source, subject, time, data from outbox_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let env = Envelope::from_parts(
        outbox_pg::EventId::from_uuid(id),
        event_type,
        source,
        subject,
        time,
        data,
    )
    .unwrap();
    let back = Envelope::<Value>::from_json(&env.to_json().unwrap()).unwrap();
    assert_eq!(back, env);
}

/// The size `enqueue` checks counts `data` as PostgreSQL renders the stored
/// jsonb, which is what the relay sends: for every kind of value, the
/// difference of two events' `message_size` is the difference of their
/// stored `data::text` lengths.
#[tokio::test]
async fn the_measured_size_of_data_is_that_of_the_stored_jsonb_text() {
    let db = TestDb::new().await.unwrap();
    let values = [
        json!(null),
        json!({}),
        json!([]),
        json!({"b": 1, "a": [1, 2, {}, []], "c": {"d": null, "e": true, "f": false}}),
        json!([
            1e300,
            -1e300,
            1.5e-7,
            5e-324,
            1.7976931348623157e308,
            -0.0,
            0.001,
            123.0
        ]),
        json!([0, -1, i64::MIN, u64::MAX, 4.5, 1e21, 1e-5, 100.25]),
        json!([
            "",
            "tab\t nl\n cr\r ff\u{c} bs\u{8} \u{1}\u{1f}",
            "quote\" back\\ slash/",
            "é ☃ 😀"
        ]),
        json!({"key with \"quotes\"": "v", "ü": [[[["deep"]]]]}),
        json!({"ones": vec![1; 1000], "big": 1e300}),
    ];
    // One time, of whole microseconds (as stored), so only `data` differs.
    let time = chrono::DateTime::from_timestamp(1_767_225_600, 123_456_000).unwrap();
    let events: Vec<Envelope<Value>> = values
        .iter()
        .map(|v| {
            Envelope::new("size.checked", "svc", "s", v.clone())
                .unwrap()
                .with_time(time)
        })
        .collect();
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::unvalidated()
        .enqueue_all(&mut tx, &events)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let null_size = events[0].message_size().unwrap();
    for event in &events {
        let stored: i32 =
            sqlx::query_scalar("select octet_length(data::text) from outbox_events where id = $1")
                .bind(event.id().as_uuid())
                .fetch_one(&db.pool)
                .await
                .unwrap();
        let measured = event.message_size().unwrap() + "null".len() - null_size;
        assert_eq!(measured, stored as usize, "{}", event.data());
    }
}

/// A transaction whose `begin` is cancelled in flight (a `select!` or a
/// timeout dropping it: the relay's WAL monitor is dropped so when its
/// session ends) leaves no session inside a transaction. With sqlx 0.9.0 the
/// pool took such a connection back with the transaction open; the next
/// statements ran in it, their row locks held for ever (the relay's marks
/// waited behind them), and its transaction id kept every new replication
/// slot on the server from being made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_cancelled_in_flight_leaves_no_transaction_open() {
    let db = TestDb::new().await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(db.url())
        .await
        .unwrap();
    // Deadlines across the begin's round trip, some of which land inside it.
    for micros in (0..400).map(|i| i % 200) {
        let begun =
            tokio::time::timeout(std::time::Duration::from_micros(micros), pool.begin()).await;
        drop(begun);
        // The one connection, back from the pool, as its next user gets it.
        let mut conn = pool.acquire().await.unwrap();
        let pid: i32 = sqlx::query_scalar("select pg_backend_pid()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        let state: Option<String> =
            sqlx::query_scalar("select state from pg_stat_activity where pid = $1")
                .bind(pid)
                .fetch_optional(&db.pool)
                .await
                .unwrap();
        assert_eq!(
            state.as_deref(),
            Some("idle"),
            "the pool handed out a session still in the transaction of a begin cancelled at {micros} µs"
        );
    }
}
