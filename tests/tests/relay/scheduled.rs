//! Scheduled events through the library: `Outbox::schedule` and `cancel`
//! inside the caller's transaction, and the relay's due lane publishing each
//! row once, at or after its time by the database's clock, in both sources.

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use outbox_pg::{Cancellation, Due, Envelope, EventId, Outbox};
use outbox_publisher::{Relay, RelayConfig, StreamSpec};
use outbox_testkit::{NatsHandle, TestDb, nats, wait_until};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

fn config() -> RelayConfig {
    RelayConfig::default()
        .backoff_base(Duration::from_millis(100))
        .backoff_max(Duration::from_millis(800))
        .publish_timeout(Duration::from_millis(500))
        .lease(Duration::from_secs(3))
}

fn event(subject: &str, n: i64) -> Envelope<Value> {
    Envelope::new(
        "orders.reminder",
        "scheduled-tests",
        subject,
        json!({"n": n}),
    )
    .unwrap()
}

async fn schedule(db: &TestDb, events: &[Envelope<Value>], due: Due) -> Vec<EventId> {
    let mut tx = db.pool.begin().await.unwrap();
    let ids = Outbox::unvalidated()
        .schedule_all(&mut tx, events, due)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    ids
}

async fn cancel(db: &TestDb, id: EventId) -> Cancellation {
    let mut tx = db.pool.begin().await.unwrap();
    let answer = Outbox::unvalidated().cancel(&mut tx, id).await.unwrap();
    tx.commit().await.unwrap();
    answer
}

async fn scalar(db: &TestDb, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(&db.pool)
        .await
        .unwrap()
}

/// Starts a relay on `db` publishing to stream `name`; cancel the token to stop it.
async fn start_relay(
    db: &TestDb,
    broker: &NatsHandle,
    name: &str,
    config: RelayConfig,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let client = async_nats::connect(broker.url()).await.unwrap();
    let relay = Relay::jetstream(
        db.pool.clone(),
        client,
        &StreamSpec::new(name, vec!["orders.>".into()]),
        config,
    )
    .await
    .unwrap();
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    let handle = tokio::spawn(async move {
        relay.run(stop.cancelled_owned()).await.unwrap();
    });
    (shutdown, handle)
}

/// Every message of stream `name` as an envelope, in stream order.
async fn received(broker: &NatsHandle, name: &str) -> Vec<Envelope<Value>> {
    let js = jetstream::new(async_nats::connect(broker.url()).await.unwrap());
    let mut stream = js.get_stream(name).await.unwrap();
    let total = stream.info().await.unwrap().state.messages as usize;
    if total == 0 {
        return Vec::new();
    }
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::with_capacity(total);
    while out.len() < total {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        out.push(Envelope::from_json(&message.payload).unwrap());
    }
    out
}

/// Scheduled rows published that went out before their due time, by the
/// database's clock.
async fn early(db: &TestDb) -> i64 {
    scalar(
        db,
        "select count(*) from outbox_events where due_at is not null and published_at < due_at",
    )
    .await
}

#[tokio::test]
async fn a_scheduled_event_is_published_once_at_its_time_and_a_cancelled_or_rolled_back_one_never()
{
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let (shutdown, handle) = start_relay(&db, &broker, "SCHEDULED", config()).await;

    let due = Due::In(Duration::from_millis(1500));
    let kept = schedule(&db, &[event("order-1", 1), event("order-2", 2)], due).await;
    let cancelled = schedule(&db, &[event("order-3", 3)], due).await[0];
    let mut tx = db.pool.begin().await.unwrap();
    let rolled_back = Outbox::unvalidated()
        .schedule(&mut tx, &event("order-4", 4), due)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    // A cancel rolled back cancels nothing.
    let mut tx = db.pool.begin().await.unwrap();
    assert_eq!(
        Outbox::unvalidated()
            .cancel(&mut tx, kept[0])
            .await
            .unwrap(),
        Cancellation::Cancelled
    );
    tx.rollback().await.unwrap();
    assert_eq!(cancel(&db, cancelled).await, Cancellation::Cancelled);
    assert_eq!(cancel(&db, cancelled).await, Cancellation::Cancelled);
    assert_eq!(cancel(&db, rolled_back).await, Cancellation::Unknown);

    // Not in the backlog, not published, while they wait.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        scalar(
            &db,
            "select count(*) from outbox_events where published_at is not null"
        )
        .await,
        0
    );
    wait_until(
        "the scheduled rows published",
        Duration::from_secs(10),
        || async {
            scalar(
                &db,
                "select count(*) from outbox_events where published_at is not null",
            )
            .await
                == 2
        },
    )
    .await
    .unwrap();
    assert_eq!(early(&db).await, 0);
    for id in &kept {
        assert_eq!(cancel(&db, *id).await, Cancellation::AlreadyPublished);
    }
    let late_ms = scalar(
        &db,
        "select coalesce(max(extract(epoch from published_at - due_at) * 1000), 0)::int8
           from outbox_events where published_at is not null",
    )
    .await;
    assert!(late_ms < 1000, "published {late_ms} ms after its due time");

    // The cancelled row is kept as the record, with who and when.
    let by: String = sqlx::query_scalar(
        "select cancelled_by from outbox_events where id = $1 and cancelled_at is not null",
    )
    .bind(cancelled.as_uuid())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(!by.is_empty());

    shutdown.cancel();
    handle.await.unwrap();
    let messages = received(&broker, "SCHEDULED").await;
    let ids: HashSet<EventId> = messages.iter().map(Envelope::id).collect();
    assert_eq!(ids, kept.iter().copied().collect::<HashSet<_>>());
    assert_eq!(messages.len(), 2, "each published once");
    for message in &messages {
        assert!(message.scheduled_for().is_some(), "carries scheduledfor");
        assert_eq!(message.sequence(), None, "and no sequence");
    }
}

#[tokio::test]
async fn the_wal_source_leaves_scheduled_rows_to_the_due_lane_which_publishes_them_at_their_time() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let wal = outbox_publisher::WalSource::from_url(db.url()).unwrap();
    let (shutdown, handle) = start_relay(&db, &broker, "WALDUE", config().source_wal(wal)).await;
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::unvalidated()
        .enqueue(&mut tx, &event("order-1", 1))
        .await
        .unwrap();
    let scheduled = Outbox::unvalidated()
        .schedule(
            &mut tx,
            &event("order-1", 0),
            Due::In(Duration::from_millis(1500)),
        )
        .await
        .unwrap();
    let cancelled = Outbox::unvalidated()
        .schedule(
            &mut tx,
            &event("order-2", 2),
            Due::In(Duration::from_millis(1500)),
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(cancel(&db, cancelled).await, Cancellation::Cancelled);
    wait_until(
        "the immediate row published",
        Duration::from_secs(20),
        || async {
            scalar(
                &db,
                "select count(*) from outbox_events where published_at is not null",
            )
            .await
                == 1
        },
    )
    .await
    .unwrap();
    wait_until(
        "the scheduled row published",
        Duration::from_secs(20),
        || async {
            scalar(
                &db,
                "select count(*) from outbox_events where published_at is not null",
            )
            .await
                == 2
        },
    )
    .await
    .unwrap();
    assert_eq!(early(&db).await, 0);
    assert_eq!(cancel(&db, scheduled).await, Cancellation::AlreadyPublished);
    shutdown.cancel();
    handle.await.unwrap();
    let messages = received(&broker, "WALDUE").await;
    let ids: Vec<EventId> = messages.iter().map(Envelope::id).collect();
    assert_eq!(ids.len(), 2);
    assert_eq!(ids[1], scheduled);
    assert!(!ids.contains(&cancelled));
    crate::support::wal::drop_slots(&db.pool).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scheduled_rows_survive_a_database_crash_and_are_published_once_after_it() {
    let mut pg = tokio::task::spawn_blocking(outbox_testkit::PgServer::start)
        .await
        .unwrap()
        .unwrap();
    let db = TestDb::on(&pg).await.unwrap();
    let broker = nats().unwrap();
    let (shutdown, handle) = start_relay(&db, &broker, "CRASH", config()).await;
    let events: Vec<_> = (0..100).map(|i| event(&format!("order-{i}"), i)).collect();
    let first = schedule(&db, &events[..50], Due::In(Duration::from_millis(500))).await;
    let second = schedule(&db, &events[50..], Due::In(Duration::from_millis(2500))).await;
    wait_until(
        "the first rows published",
        Duration::from_secs(10),
        || async {
            scalar(
                &db,
                "select count(*) from outbox_events where published_at is not null",
            )
            .await
                == 50
        },
    )
    .await
    .unwrap();
    // PostgreSQL crashes (immediate shutdown) with the second rows waiting.
    tokio::task::block_in_place(|| pg.restart()).unwrap();
    wait_until("every row published", Duration::from_secs(60), || async {
        sqlx::query_scalar::<_, i64>(
            "select count(*) from outbox_events where published_at is not null",
        )
        .fetch_one(&db.pool)
        .await
        .is_ok_and(|n| n == 100)
    })
    .await
    .unwrap();
    assert_eq!(early(&db).await, 0);
    shutdown.cancel();
    handle.await.unwrap();
    let messages = received(&broker, "CRASH").await;
    let ids: HashSet<EventId> = messages.iter().map(Envelope::id).collect();
    assert_eq!(messages.len(), 100, "each once");
    assert!(first.iter().chain(&second).all(|id| ids.contains(id)));
}

#[tokio::test]
async fn a_drain_publishes_the_scheduled_rows_due_when_it_starts_and_leaves_the_others() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let due: Vec<_> = (0..30).map(|i| event(&format!("order-{i}"), i)).collect();
    let due = schedule(&db, &due, Due::In(Duration::from_millis(200))).await;
    let later = schedule(
        &db,
        &[event("order-later", 99)],
        Due::In(Duration::from_secs(3600)),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let client = async_nats::connect(broker.url()).await.unwrap();
    let relay = Relay::jetstream(
        db.pool.clone(),
        client,
        &StreamSpec::new("DRAIN", vec!["orders.>".into()]),
        config(),
    )
    .await
    .unwrap();
    let report = tokio::time::timeout(Duration::from_secs(30), relay.drain())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.published, 30, "{report:?}");
    let ids: HashSet<EventId> = received(&broker, "DRAIN")
        .await
        .iter()
        .map(Envelope::id)
        .collect();
    assert_eq!(ids, due.into_iter().collect::<HashSet<_>>());
    assert_eq!(cancel(&db, later[0]).await, Cancellation::Cancelled);
}

#[tokio::test]
async fn retention_deletes_cancelled_rows_once_the_window_has_passed() {
    let db = TestDb::new().await.unwrap();
    let ids = schedule(
        &db,
        &[event("order-1", 1), event("order-2", 2)],
        Due::In(Duration::from_secs(3600)),
    )
    .await;
    assert_eq!(cancel(&db, ids[0]).await, Cancellation::Cancelled);
    assert_eq!(cancel(&db, ids[1]).await, Cancellation::Cancelled);
    sqlx::query("update outbox_events set cancelled_at = now() - interval '2 days' where id = $1")
        .bind(ids[0].as_uuid())
        .execute(&db.pool)
        .await
        .unwrap();
    let broker = nats().unwrap();
    let client = async_nats::connect(broker.url()).await.unwrap();
    let relay = Relay::jetstream(
        db.pool.clone(),
        client,
        &StreamSpec::new("PRUNE", vec!["orders.>".into()]),
        config().retention(Some(Duration::from_secs(24 * 3600))),
    )
    .await
    .unwrap();
    assert_eq!(relay.prune().await.unwrap(), 1);
    assert_eq!(cancel(&db, ids[0]).await, Cancellation::Unknown);
    assert_eq!(cancel(&db, ids[1]).await, Cancellation::Cancelled);
}

#[tokio::test]
async fn a_scheduled_event_neither_holds_back_nor_waits_for_its_entitys_immediate_events() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let scheduled = schedule(&db, &[event("order-1", 0)], Due::In(Duration::from_secs(2))).await[0];
    let mut tx = db.pool.begin().await.unwrap();
    Outbox::unvalidated()
        .enqueue_all(&mut tx, &[event("order-1", 1), event("order-1", 2)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // A due time already past at insert: an immediate event, in the order.
    let past = schedule(
        &db,
        &[event("order-1", 3)],
        Due::At(chrono::Utc::now() - chrono::Duration::hours(1)),
    )
    .await[0];
    let (shutdown, handle) = start_relay(&db, &broker, "ORDER", config()).await;
    wait_until(
        "the immediate rows published",
        Duration::from_secs(10),
        || async {
            scalar(
                &db,
                "select count(*) from outbox_events where published_at is not null",
            )
            .await
                == 3
        },
    )
    .await
    .unwrap();
    assert_eq!(
        scalar(
            &db,
            "select count(*) from outbox_events where published_at is null and due_at is not null"
        )
        .await,
        1,
        "the scheduled row still waits"
    );
    wait_until(
        "the scheduled row published",
        Duration::from_secs(10),
        || async {
            scalar(
                &db,
                "select count(*) from outbox_events where published_at is null",
            )
            .await
                == 0
        },
    )
    .await
    .unwrap();
    shutdown.cancel();
    handle.await.unwrap();

    let messages = received(&broker, "ORDER").await;
    let order: Vec<i64> = messages
        .iter()
        .map(|m| m.data()["n"].as_i64().unwrap())
        .collect();
    assert_eq!(order, [1, 2, 3, 0]);
    let sequences: Vec<Option<u64>> = messages.iter().map(Envelope::sequence).collect();
    assert!(sequences[..3].iter().all(Option::is_some));
    assert!(sequences[0] < sequences[1] && sequences[1] < sequences[2]);
    assert_eq!(messages[3].id(), scheduled);
    assert_eq!(messages[3].sequence(), None);
    assert!(messages[3].scheduled_for().is_some());
    assert_eq!(messages[2].id(), past);
    assert_eq!(messages[2].scheduled_for(), None);
    assert_eq!(cancel(&db, past).await, Cancellation::AlreadyPublished);
}

#[tokio::test]
async fn one_entitys_scheduled_events_go_out_by_due_time_then_in_insert_order() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let soon = chrono::Utc::now() + chrono::Duration::milliseconds(1500);
    // Written latest-due first; those due at one time in one statement.
    schedule(
        &db,
        &[event("order-1", 100)],
        Due::At(soon + chrono::Duration::milliseconds(500)),
    )
    .await;
    let same: Vec<_> = (0..10).map(|n| event("order-1", n)).collect();
    schedule(&db, &same, Due::At(soon)).await;
    schedule(&db, &[event("order-1", 10)], Due::At(soon)).await;
    let (shutdown, handle) = start_relay(&db, &broker, "DUEORDER", config()).await;
    wait_until("all published", Duration::from_secs(15), || async {
        scalar(
            &db,
            "select count(*) from outbox_events where published_at is null",
        )
        .await
            == 0
    })
    .await
    .unwrap();
    shutdown.cancel();
    handle.await.unwrap();
    let order: Vec<i64> = received(&broker, "DUEORDER")
        .await
        .iter()
        .map(|m| m.data()["n"].as_i64().unwrap())
        .collect();
    assert_eq!(order, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 100]);
    assert_eq!(early(&db).await, 0);
}

#[tokio::test]
async fn no_update_makes_a_scheduled_row_due_early_and_plain_sql_schedules_by_the_column() {
    let db = TestDb::new().await.unwrap();
    sqlx::raw_sql(
        "insert into outbox_events (id, event_type, source, subject, time, data, due_at)
         values ('0190a3c2-0000-7000-8000-000000000001', 'orders.reminder', 'sql', 'order-9',
                 now(), '{}', now() + interval '1 hour'),
                ('0190a3c2-0000-7000-8000-000000000002', 'orders.reminder', 'sql', 'order-9',
                 now(), '{}', now() - interval '1 second')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // A due time no relay could reach is refused, naming the column.
    for bad in ["'infinity'", "'10000-01-01 00:00:00+00'"] {
        let err = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "insert into outbox_events (id, event_type, source, subject, time, data, due_at)
             values (gen_random_uuid(), 'orders.reminder', 'sql', 'order-9', now(), '{{}}', {bad})"
        )))
        .execute(&db.pool)
        .await
        .unwrap_err();
        assert!(err.to_string().contains("due_at"), "{err}");
    }
    // The future row waits in the due lane; the past one is an immediate event.
    assert_eq!(
        scalar(&db, "select count(*) from outbox_events where due_at is not null and next_attempt_at = due_at").await,
        1
    );
    assert_eq!(
        scalar(
            &db,
            "select count(*) from outbox_events where due_at is null and next_attempt_at is null"
        )
        .await,
        1
    );
    // An operator's retry, or any update, cannot bring it forward.
    sqlx::raw_sql("update outbox_events set next_attempt_at = now(), attempts = 0")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::raw_sql("update outbox_events set next_attempt_at = null")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        scalar(&db, "select count(*) from outbox_events where due_at is not null and next_attempt_at >= due_at").await,
        1
    );
    // Moving the due time before the release moves the row with it.
    sqlx::raw_sql(
        "update outbox_events set due_at = now() + interval '2 hours' where due_at is not null",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        scalar(&db, "select count(*) from outbox_events where due_at is not null and next_attempt_at = due_at and due_at > now() + interval '90 minutes'").await,
        1
    );
    let broker = nats().unwrap();
    let client = async_nats::connect(broker.url()).await.unwrap();
    let relay = Relay::jetstream(
        db.pool.clone(),
        client,
        &StreamSpec::new("PLAIN", vec!["orders.>".into()]),
        config(),
    )
    .await
    .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!(report.published, 1, "only the immediate row: {report:?}");
    assert_eq!(
        scalar(
            &db,
            "select count(*) from outbox_events where published_at is null and due_at is not null"
        )
        .await,
        1
    );
}

#[tokio::test]
async fn a_nearer_due_time_wakes_the_sleeping_due_lane() {
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    // Nothing due for a minute: the due lane sleeps its longest.
    schedule(
        &db,
        &[event("order-far", 0)],
        Due::In(Duration::from_secs(60)),
    )
    .await;
    let (shutdown, handle) = start_relay(&db, &broker, "WAKE", config()).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    for round in 0..3 {
        let id = schedule(
            &db,
            &[event(&format!("order-near-{round}"), round)],
            Due::In(Duration::from_millis(300)),
        )
        .await[0];
        wait_until(
            "the near row published",
            Duration::from_secs(10),
            || async {
                sqlx::query_scalar::<_, bool>(
                    "select published_at is not null from outbox_events where id = $1",
                )
                .bind(id.as_uuid())
                .fetch_one(&db.pool)
                .await
                .unwrap()
            },
        )
        .await
        .unwrap();
        let late_ms: i64 = sqlx::query_scalar(
            "select (extract(epoch from published_at - due_at) * 1000)::int8
               from outbox_events where id = $1",
        )
        .bind(id.as_uuid())
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert!(
            (0..1000).contains(&late_ms),
            "round {round}: {late_ms} ms late"
        );
    }
    shutdown.cancel();
    handle.await.unwrap();
}

#[tokio::test]
async fn cancels_racing_the_due_time_are_either_cancelled_and_never_published_or_already_published()
{
    let db = TestDb::new().await.unwrap();
    let broker = nats().unwrap();
    let (shutdown, handle) = start_relay(&db, &broker, "RACE", config()).await;
    let events: Vec<_> = (0..200).map(|i| event(&format!("order-{i}"), i)).collect();
    let ids = schedule(&db, &events, Due::In(Duration::from_millis(1000))).await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    let mut cancels = Vec::new();
    for (i, id) in ids.iter().copied().enumerate() {
        let pool = db.pool.clone();
        cancels.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(i as u64)).await;
            let mut tx = pool.begin().await.unwrap();
            let answer = Outbox::unvalidated().cancel(&mut tx, id).await.unwrap();
            tx.commit().await.unwrap();
            (id, answer)
        }));
    }
    let mut answers = Vec::new();
    for cancel in cancels {
        answers.push(cancel.await.unwrap());
    }
    wait_until("every row resolved", Duration::from_secs(20), || async {
        scalar(
            &db,
            "select count(*) from outbox_events where published_at is null and cancelled_at is null",
        )
        .await
            == 0
    })
    .await
    .unwrap();
    shutdown.cancel();
    handle.await.unwrap();
    let published: HashSet<EventId> = received(&broker, "RACE")
        .await
        .iter()
        .map(Envelope::id)
        .collect();
    let mut cancelled = 0;
    for (id, answer) in answers {
        match answer {
            Cancellation::Cancelled => {
                cancelled += 1;
                assert!(!published.contains(&id), "{id} cancelled and published");
            }
            Cancellation::AlreadyPublished => {
                assert!(
                    published.contains(&id),
                    "{id} answered published, never was"
                );
            }
            other => panic!("{id}: {other:?}"),
        }
    }
    assert_eq!(early(&db).await, 0);
    eprintln!("{cancelled} of 200 cancelled in time");
}

/// The backlog gauges as the relay reads them (its `stats.sql` and
/// `stats_scheduled.sql`): backlog, past cap, oldest age (s), scheduled,
/// next due (Unix s).
async fn gauges(db: &TestDb) -> (i64, i64, f64, i64, Option<f64>) {
    let (backlog, past_cap, oldest, next_due): (i64, i64, f64, Option<f64>) =
        sqlx::query_as(include_str!("../../../outbox-publisher/queries/stats.sql"))
            .bind(20_i32)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let scheduled: i64 = sqlx::query_scalar(include_str!(
        "../../../outbox-publisher/queries/stats_scheduled.sql"
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    (backlog, past_cap, oldest, scheduled, next_due)
}

#[tokio::test]
async fn the_gauges_count_scheduled_rows_apart_from_the_backlog_until_they_fall_due() {
    let db = TestDb::new().await.unwrap();
    let future = schedule(
        &db,
        &(0..5).map(|i| event("order-1", i)).collect::<Vec<_>>(),
        Due::In(Duration::from_secs(3600)),
    )
    .await;
    let (backlog, past_cap, oldest, scheduled, next_due) = gauges(&db).await;
    assert_eq!((backlog, past_cap, scheduled), (0, 0, 5));
    assert_eq!(oldest, 0.0);
    let in_an_hour = next_due.unwrap() - chrono::Utc::now().timestamp() as f64;
    assert!((3500.0..3700.0).contains(&in_an_hour), "{in_an_hour}");

    // Cancelled: counted nowhere.
    assert_eq!(cancel(&db, future[0]).await, Cancellation::Cancelled);
    assert_eq!(gauges(&db).await.3, 4);
    // Fallen due ten minutes ago and backed off after a failure: backlog,
    // aged from its due time.
    sqlx::query(
        "update outbox_events set due_at = now() - interval '10 minutes', released_at = now(),
                attempts = 1, next_attempt_at = now() + interval '1 minute' where id = $1",
    )
    .bind(future[1].as_uuid())
    .execute(&db.pool)
    .await
    .unwrap();
    // Parked at the cap, and another skipped by an operator.
    sqlx::query(
        "update outbox_events set due_at = now() - interval '1 minute', released_at = now(),
                attempts = 20, next_attempt_at = 'infinity' where id = any($1)",
    )
    .bind([*future[2].as_uuid(), *future[3].as_uuid()])
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("update outbox_events set skipped_at = now() where id = $1")
        .bind(future[3].as_uuid())
        .execute(&db.pool)
        .await
        .unwrap();
    let (backlog, past_cap, oldest, scheduled, _) = gauges(&db).await;
    assert_eq!((backlog, past_cap, scheduled), (1, 1, 1));
    assert!((590.0..700.0).contains(&oldest), "{oldest}");
}
