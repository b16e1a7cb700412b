//! inbox-consumer against real PostgreSQL and nats-server: transactional dedupe,
//! ack after commit, retries, dead letters, per-subject order, replicas,
//! consume → produce, stale events, shutdown and retention.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use futures::StreamExt;
use futures::future::BoxFuture;
use inbox_consumer::{
    Consumer, ConsumerConfig, Dedupe, DedupeLayer, Delivery, ErrorKind, Handler, HandlerError,
    HandlerService, MetricsLayer, Outcome, Retention, Router, SkipStaleLayer, Unrouted,
};
use outbox_pg::Envelope;
use outbox_testkit::{TestDb, wait_until};
use serde_json::{Value, json};
use sqlx::PgTransaction;
use tokio::sync::oneshot;
use tower::{Service, ServiceBuilder, ServiceExt};

use super::world::*;

// ---------------------------------------------------------------------------

#[tokio::test]
async fn the_same_event_published_twice_and_redelivered_has_one_effect() {
    let w = world("INBOX_DUP").await;
    let handler = Record::new("a");
    let config = config(&w, "dup").ack_wait(Duration::from_secs(1));
    let consumer = Consumer::new(w.db.pool.clone(), w.js.clone(), config)
        .await
        .unwrap();

    let e = event("t.ok", "sub_1", json!({"seq": 1}));
    // Two publishes with different Nats-Msg-Id: both are stored in the stream.
    w.publish_raw("t.ok", e.to_json().unwrap(), "first").await;
    w.publish_raw("t.ok", e.to_json().unwrap(), "second").await;

    // The first copy is handled by hand through the same stack, and never acked.
    let durable: jetstream::consumer::PullConsumer =
        w.js.get_stream(&w.stream)
            .await
            .unwrap()
            .get_consumer("dup")
            .await
            .unwrap();
    let mut batch = durable.fetch().max_messages(1).messages().await.unwrap();
    let message = batch.next().await.unwrap().unwrap();
    let delivery = Delivery::from_message(&message).unwrap();
    assert_eq!(delivery.info().delivered, 1);
    assert_eq!(delivery.consumer(), "dup");
    let outcome = stack(&w.db.pool, handler.clone())
        .oneshot(delivery)
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Handled);
    drop(message);

    // The runtime gets the second copy now and the first one's redelivery
    // after ack_wait: both are duplicates.
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(stack(&w.db.pool, handler.clone()), async {
        let _ = stopped.await;
    }));
    let running = Running {
        stop: Some(stop),
        task,
    };
    wait_until("two duplicates counted", WAIT, || async {
        counter("inbox_duplicates_total", "dup") == 2
    })
    .await
    .unwrap();
    w.wait_settled("dup").await;
    assert_eq!(w.count("select count(*) from effects").await, 1);
    assert_eq!(
        w.count("select count(*) from inbox_events where consumer = 'dup'")
            .await,
        1
    );
    assert_eq!(counter("inbox_handled_total", "dup"), 1);
    assert_eq!(handler.attempts(&e), 1, "the handler ran once");
    running.shutdown().await;
}

/// Wraps a stack; after the first commit it reports, then hangs like a process
/// frozen between commit and ack.
#[derive(Clone)]
struct HangAfterCommit<S> {
    inner: S,
    committed: Arc<AtomicBool>,
}

impl<S> Service<Delivery> for HangAfterCommit<S>
where
    S: Service<Delivery, Response = Outcome> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Outcome;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Outcome, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, d: Delivery) -> Self::Future {
        let fut = self.inner.call(d);
        let committed = self.committed.clone();
        Box::pin(async move {
            let out = fut.await?;
            committed.store(true, Ordering::SeqCst);
            std::future::pending::<()>().await;
            Ok(out)
        })
    }
}

#[tokio::test]
async fn commit_then_death_before_ack_is_redelivered_with_one_effect() {
    let w = world("INBOX_CRASH").await;
    let config = config(&w, "crash").ack_wait(Duration::from_secs(1));
    let committed = Arc::new(AtomicBool::new(false));
    let dying = HangAfterCommit {
        inner: stack(&w.db.pool, Record::new("a")),
        committed: committed.clone(),
    };
    let first = start(&w, config.clone(), dying).await;

    w.publish(&event("t.ok", "sub_1", json!({"seq": 1}))).await;
    wait_until("first process committed", WAIT, || async {
        committed.load(Ordering::SeqCst)
    })
    .await
    .unwrap();
    // The process dies: its tasks are dropped mid-flight, nothing is acked.
    first.task.abort();
    let _ = first.task.await;
    assert_eq!(w.count("select count(*) from effects").await, 1);

    let second = start(&w, config, stack(&w.db.pool, Record::new("b"))).await;
    wait_until("redelivery seen as a duplicate", WAIT, || async {
        counter("inbox_duplicates_total", "crash") == 1
    })
    .await
    .unwrap();
    w.wait_settled("crash").await;
    assert_eq!(w.count("select count(*) from effects").await, 1);
    assert_eq!(
        w.count("select count(*) from effects where replica = 'a'")
            .await,
        1
    );
    second.shutdown().await;
}

#[tokio::test]
async fn a_handler_error_rolls_back_and_the_retry_succeeds_once() {
    let w = world("INBOX_RETRY").await;
    let handler = Record::new("a");
    let running = start(&w, config(&w, "retry"), stack(&w.db.pool, handler.clone())).await;

    let e = event("t.ok", "sub_1", json!({"seq": 1, "mode": "fail_once"}));
    w.publish(&e).await;
    w.wait_count("effect committed", "select count(*) from effects", 1)
        .await;
    w.wait_settled("retry").await;
    assert_eq!(handler.attempts(&e), 2, "failed once, then succeeded");
    // The failed attempt's effect and inbox row were rolled back.
    assert_eq!(w.count("select count(*) from effects").await, 1);
    assert_eq!(w.count("select count(*) from inbox_events").await, 1);
    assert_eq!(counter("inbox_failed_total", "retry"), 1);
    assert_eq!(counter("inbox_handled_total", "retry"), 1);
    assert_eq!(counter("inbox_duplicates_total", "retry"), 0);
    running.shutdown().await;
}

#[tokio::test]
async fn an_ordered_leaders_handler_returning_ok_on_an_aborted_transaction_is_never_acked_as_handled()
 {
    // A leader's fence check stands for the aborted-transaction check.
    let w = world("INBOX_SWALLOW_ORDERED").await;
    let handler = Record::new("a");
    let config = config(&w, "swallow").ordered(true).max_deliver(2);
    let running = start(&w, config, stack(&w.db.pool, handler.clone())).await;
    let swallowed = event("t.ok", "sub_s", json!({"seq": 1, "mode": "swallow_error"}));
    let good = event("t.ok", "sub_g", json!({"seq": 2}));
    w.publish(&swallowed).await;
    w.publish(&good).await;
    w.wait_count(
        "the swallowed failure dead-lettered",
        "select count(*) from inbox_dead_letters",
        1,
    )
    .await;
    w.wait_count("the good event's effect", "select count(*) from effects", 1)
        .await;
    w.wait_settled("swallow").await;
    let error: String = sqlx::query_scalar("select error from inbox_dead_letters")
        .fetch_one(&w.db.pool)
        .await
        .unwrap();
    assert!(error.contains("transaction is aborted"), "{error}");
    let seqs: Vec<i64> = sqlx::query_scalar("select seq from effects")
        .fetch_all(&w.db.pool)
        .await
        .unwrap();
    assert_eq!(seqs, vec![2]);
    assert_eq!(w.count("select count(*) from inbox_events").await, 1);
    running.shutdown().await;
}

/// reason, payload, headers, event_id, delivery_count, subject, error
type DeadLetterRow = (
    String,
    Vec<u8>,
    Value,
    Option<uuid::Uuid>,
    i64,
    String,
    String,
);

/// A CloudEvent whose attribute `name` is 100,000 characters long.
fn long_attribute(name: &str) -> Vec<u8> {
    let mut event = json!({"specversion": "1.0", "id": uuid::Uuid::now_v7().to_string(),
                           "source": "s", "type": "t.ok", "subject": "s",
                           "time": "2026-01-01T00:00:00Z", "data": {"seq": 1}});
    let mut x: u64 = 1;
    let long: String = (0..100_000)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            char::from(b'a' + u8::try_from((x >> 33) % 26).unwrap())
        })
        .collect();
    event[name] = json!(format!("t.{long}"));
    serde_json::to_vec(&event).unwrap()
}

#[tokio::test]
async fn poison_messages_are_dead_lettered_and_the_consumer_goes_on() {
    let w = world("INBOX_POISON").await;
    w.js.create_stream(stream::Config {
        name: "INBOX_POISON_DLQ".into(),
        subjects: vec!["dlq.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let handler = Record::new("a");
    let config = config(&w, "poison")
        .max_deliver(3)
        .unrouted(Unrouted::DeadLetter)
        .dead_letter_subject("dlq.poison");
    let running = start(&w, config, stack(&w.db.pool, handler.clone())).await;

    let no_id = json!({"specversion": "1.0", "source": "s", "type": "t.ok", "subject": "s",
                        "time": "2026-01-01T00:00:00Z", "data": {"seq": 1}});
    let bad_id = json!({"specversion": "1.0", "id": "42", "source": "s", "type": "t.ok",
                         "subject": "s", "time": "2026-01-01T00:00:00Z", "data": {"seq": 1}});
    let undecodable = event("t.ok", "sub_u", json!({"seq": "not a number"}));
    let rejected = event("t.ok", "sub_r", json!({"seq": 1, "mode": "reject"}));
    let exhausted = event("t.ok", "sub_x", json!({"seq": 1, "mode": "always_fail"}));
    let unroutable = event("t.unknown", "sub_n", json!({"seq": 1}));
    let swallowed = event("t.ok", "sub_s", json!({"seq": 1, "mode": "swallow_error"}));
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("t.ok", b"\x00\x01 not json".to_vec(), "not_json"),
        ("t.ok", br#"{"hello": "world"}"#.to_vec(), "not_cloudevent"),
        ("t.ok", serde_json::to_vec(&no_id).unwrap(), "invalid_id"),
        ("t.ok", serde_json::to_vec(&bad_id).unwrap(), "invalid_id"),
        (
            "t.ok",
            undecodable.to_json().unwrap(),
            "undecodable_payload",
        ),
        ("t.ok", rejected.to_json().unwrap(), "rejected"),
        ("t.ok", exhausted.to_json().unwrap(), "max_deliveries"),
        ("t.unknown", unroutable.to_json().unwrap(), "unroutable"),
        // Ok on an aborted transaction is never acked as handled.
        ("t.ok", swallowed.to_json().unwrap(), "max_deliveries"),
        // Attributes of any length (another producer's): dead-lettered with
        // a short error, never written to an inbox index.
        ("t.ok", long_attribute("subject"), "not_cloudevent"),
        ("t.ok", long_attribute("source"), "not_cloudevent"),
        ("t.ok", long_attribute("type"), "not_cloudevent"),
    ];
    for (i, (subject, body, _)) in cases.iter().enumerate() {
        w.publish_raw(subject, body.clone(), &format!("poison-{i}"))
            .await;
    }
    let good = event("t.ok", "sub_g", json!({"seq": 7}));
    w.publish(&good).await;

    w.wait_count(
        "every poison message dead-lettered",
        "select count(*) from inbox_dead_letters",
        cases.len() as i64,
    )
    .await;
    w.wait_settled("poison").await;
    // Only the good event has an effect that committed.
    let seqs: Vec<i64> = sqlx::query_scalar("select seq from effects")
        .fetch_all(&w.db.pool)
        .await
        .unwrap();
    assert_eq!(seqs, vec![7]);

    let rows: Vec<DeadLetterRow> = sqlx::query_as(
        "select reason, payload, headers, event_id, delivery_count, subject, error
           from inbox_dead_letters where consumer = 'poison' order by stream_sequence",
    )
    .fetch_all(&w.db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), cases.len());
    for (i, ((subject, body, reason), row)) in cases.iter().zip(&rows).enumerate() {
        assert_eq!(row.0, *reason, "case {i}: {}", row.6);
        assert_eq!(row.1, *body, "case {i}: raw bytes kept");
        assert_eq!(
            row.2["Nats-Msg-Id"],
            json!([format!("poison-{i}")]),
            "case {i}"
        );
        assert_eq!(row.5, *subject);
        assert!(!row.6.is_empty());
        assert!(
            row.6.len() < 600,
            "case {i}: {} bytes of error",
            row.6.len()
        );
    }
    assert_eq!(rows[4].3, Some(*undecodable.id().as_uuid()));
    assert_eq!(rows[6].4, 3, "dead-lettered on the last allowed delivery");
    assert_eq!(handler.attempts(&exhausted), 3);
    assert!(rows[8].6.contains("aborted"), "{}", rows[8].6);
    assert_eq!(w.count("select count(*) from inbox_events").await, 1);
    assert_eq!(
        counter("inbox_dead_lettered_total", "poison"),
        cases.len() as u64
    );

    // Also published to the DLQ subject, with the reason as a header.
    let mut dlq = w.js.get_stream("INBOX_POISON_DLQ").await.unwrap();
    assert_eq!(dlq.info().await.unwrap().state.messages, cases.len() as u64);
    let mut dlq_reasons = Vec::new();
    for seq in 1..=cases.len() as u64 {
        let m = dlq.get_raw_message(seq).await.unwrap();
        let reason = m.headers.get("Inbox-Dead-Letter-Reason").unwrap();
        dlq_reasons.push(reason.as_str().to_owned());
    }
    dlq_reasons.sort();
    let mut reasons: Vec<String> = cases.iter().map(|c| c.2.to_owned()).collect();
    reasons.sort();
    assert_eq!(dlq_reasons, reasons);
    running.shutdown().await;
}

#[tokio::test]
async fn concurrency_16_keeps_per_subject_stream_order() {
    let w = world("INBOX_ORDER").await;
    let handler = Record::new("a");
    let config = config(&w, "order").concurrency(16);
    let running = start(&w, config, stack(&w.db.pool, handler.clone())).await;

    let events: Vec<_> = (0..1_000)
        .map(|seq| event("t.ok", &format!("sub_{}", seq % 50), json!({"seq": seq})))
        .collect();
    w.publish_all(&events).await;
    w.wait_count("1,000 effects", "select count(*) from effects", 1_000)
        .await;
    w.wait_settled("order").await;

    let rows: Vec<(String, i64)> = sqlx::query_as("select subject, seq from effects order by n")
        .fetch_all(&w.db.pool)
        .await
        .unwrap();
    assert_eq!(rows.len(), 1_000);
    let mut by_subject: HashMap<String, Vec<i64>> = HashMap::new();
    for (subject, seq) in rows {
        by_subject.entry(subject).or_default().push(seq);
    }
    assert_eq!(by_subject.len(), 50);
    for (subject, seqs) in &by_subject {
        assert!(
            seqs.is_sorted(),
            "{subject}: effects out of stream order: {seqs:?}"
        );
        assert_eq!(seqs.len(), 20);
    }
    let max = handler.state.max_in_flight.load(Ordering::SeqCst);
    assert!((2..=16).contains(&max), "max in flight {max}");
    running.shutdown().await;
}

#[tokio::test]
async fn two_replicas_share_the_work_with_one_effect_per_event() {
    let w = world("INBOX_REPLICAS").await;
    let config = config(&w, "replicas").concurrency(4).batch(4);
    let a = Record::new("a");
    let b = Record::new("b");
    let ra = start(&w, config.clone(), stack(&w.db.pool, a.clone())).await;
    let rb = start(&w, config, stack(&w.db.pool, b.clone())).await;

    // 100 events, each published twice with different message ids.
    for seq in 0..100 {
        let e = event(
            "t.ok",
            &format!("sub_{seq}"),
            json!({"seq": seq, "mode": if seq % 10 == 0 { "slow" } else { "ok" }}),
        );
        for copy in 0..2 {
            w.publish_raw("t.ok", e.to_json().unwrap(), &format!("{}-{copy}", e.id()))
                .await;
        }
    }
    w.wait_count("100 effects", "select count(*) from effects", 100)
        .await;
    wait_until("every copy seen", WAIT, || async {
        counter("inbox_duplicates_total", "replicas") == 100
    })
    .await
    .unwrap();
    w.wait_settled("replicas").await;
    assert_eq!(w.count("select count(*) from effects").await, 100);
    assert_eq!(
        w.count("select count(distinct event_id) from effects")
            .await,
        100
    );
    let by_a = w
        .count("select count(*) from effects where replica = 'a'")
        .await;
    let by_b = w
        .count("select count(*) from effects where replica = 'b'")
        .await;
    assert!(by_a > 0 && by_b > 0, "work shared: a={by_a} b={by_b}");
    ra.shutdown().await;
    rb.shutdown().await;
}

#[tokio::test]
async fn a_follow_on_event_commits_with_the_effect_or_not_at_all() {
    let w = world("INBOX_PRODUCE").await;
    let handler = Record::new("a");
    let running = start(
        &w,
        config(&w, "produce"),
        stack(&w.db.pool, handler.clone()),
    )
    .await;

    let retried = event(
        "t.ok",
        "sub_1",
        json!({"seq": 1, "mode": "enqueue_fail_once"}),
    );
    let rejected = event("t.ok", "sub_2", json!({"seq": 2, "mode": "enqueue_reject"}));
    w.publish(&retried).await;
    w.publish(&rejected).await;
    w.wait_count("dead letter", "select count(*) from inbox_dead_letters", 1)
        .await;
    w.wait_count("effect", "select count(*) from effects", 1)
        .await;
    w.wait_settled("produce").await;

    assert_eq!(handler.attempts(&retried), 2);
    let follow_ons: Vec<(String, Value)> =
        sqlx::query_as("select subject, data from outbox_events")
            .fetch_all(&w.db.pool)
            .await
            .unwrap();
    // The failed attempt's event rolled back with its effect; the rejected one never committed.
    assert_eq!(
        follow_ons,
        vec![("sub_1".to_string(), json!({"caused_by": retried.id()}))]
    );
    let effect_subjects: Vec<String> = sqlx::query_scalar("select subject from effects")
        .fetch_all(&w.db.pool)
        .await
        .unwrap();
    assert_eq!(effect_subjects, vec!["sub_1".to_string()]);
    running.shutdown().await;
}

#[tokio::test]
async fn a_stale_event_is_skipped_for_order_dependent_handlers() {
    let w = world("INBOX_STALE").await;
    let pool = w.db.pool.clone();
    let service = ServiceBuilder::new()
        .layer(MetricsLayer::new())
        .layer(DedupeLayer::new(pool.clone()))
        .service(
            Router::new().route(
                "t.ok",
                ServiceBuilder::new()
                    .layer(SkipStaleLayer::new())
                    .service(HandlerService::new(Record::new("a"))),
            ),
        );
    let running = start(&w, config(&w, "stale"), service).await;

    let t0 = chrono::Utc::now();
    let newer = event("t.ok", "sub_1", json!({"seq": 2})).with_time(t0);
    let older =
        event("t.ok", "sub_1", json!({"seq": 1})).with_time(t0 - chrono::Duration::seconds(5));
    w.publish(&newer).await;
    w.publish(&older).await;
    wait_until("stale skip counted", WAIT, || async {
        counter("inbox_stale_total", "stale") == 1
    })
    .await
    .unwrap();
    w.wait_settled("stale").await;
    let seqs: Vec<i64> = sqlx::query_scalar("select seq from effects")
        .fetch_all(&w.db.pool)
        .await
        .unwrap();
    assert_eq!(
        seqs,
        vec![2],
        "the older event did not overwrite the newer one"
    );
    // Both are in the inbox: a redelivery of the stale one is a duplicate.
    assert_eq!(w.count("select count(*) from inbox_events").await, 2);
    running.shutdown().await;
}

/// An order-dependent effect: the subject's current value, and every value it
/// took, in commit order (the row lock orders the updates).
#[derive(Clone)]
struct SetCurrent;

impl Handler for SetCurrent {
    type Message = Payload;

    async fn handle(
        &self,
        event: Envelope<Payload>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        // Widen the window between SkipStale's read and this write.
        sqlx::query("select pg_sleep(0.005)")
            .execute(&mut **tx)
            .await?;
        sqlx::query(
            "insert into current (subject, seq, history) values ($1, $2, array[$2])
             on conflict (subject) do update
               set seq = excluded.seq, history = current.history || excluded.seq",
        )
        .bind(event.subject())
        .bind(event.data().seq)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

#[tokio::test]
async fn two_replicas_hammering_one_subject_never_apply_an_older_event_after_a_newer_one() {
    let w = world("INBOX_STALE_RACE").await;
    sqlx::query("create table current (subject text primary key, seq bigint not null, history bigint[] not null)")
        .execute(&w.db.pool)
        .await
        .unwrap();
    let service = || {
        ServiceBuilder::new()
            .layer(MetricsLayer::new()) // counts the stale skips
            .layer(DedupeLayer::new(w.db.pool.clone()))
            .service(
                Router::new().route(
                    "t.ok",
                    ServiceBuilder::new()
                        .layer(SkipStaleLayer::new())
                        .service(HandlerService::new(SetCurrent)),
                ),
            )
    };
    let config = config(&w, "stale_race").concurrency(4).batch(1);
    let ra = start(&w, config.clone(), service()).await;
    let rb = start(&w, config, service()).await;

    let n = 300;
    let t0 = chrono::Utc::now();
    let events: Vec<_> = (0..n)
        .map(|seq| {
            event("t.ok", "sub_hot", json!({"seq": seq}))
                .with_time(t0 + chrono::Duration::milliseconds(seq))
        })
        .collect();
    w.publish_all(&events).await;
    w.wait_count(
        "every event in the inbox",
        "select count(*) from inbox_events",
        n,
    )
    .await;
    w.wait_settled("stale_race").await;

    let (seq, history): (i64, Vec<i64>) =
        sqlx::query_as("select seq, history from current where subject = 'sub_hot'")
            .fetch_one(&w.db.pool)
            .await
            .unwrap();
    let inversion = history.windows(2).find(|pair| pair[0] >= pair[1]);
    assert_eq!(
        inversion,
        None,
        "an older event was applied after a newer one ({} effects)",
        history.len()
    );
    assert_eq!(seq, n - 1, "the newest event's effect was lost");
    let stale = counter("inbox_stale_total", "stale_race");
    assert_eq!(
        history.len() as u64 + stale,
        n as u64,
        "every event applied or skipped as stale, once"
    );
    ra.shutdown().await;
    rb.shutdown().await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_commits_and_acks_in_flight_work() {
    let w = world("INBOX_SHUTDOWN").await;
    let handler = Record::new("a");
    let running = start(
        &w,
        config(&w, "shutdown"),
        stack(&w.db.pool, handler.clone()),
    )
    .await;
    for seq in 0..4 {
        w.publish(&event(
            "t.ok",
            &format!("sub_{seq}"),
            json!({"seq": seq, "mode": "slow"}),
        ))
        .await;
    }
    wait_until("handlers running", WAIT, || async {
        handler.state.in_flight.load(Ordering::SeqCst) > 0
    })
    .await
    .unwrap();
    running.shutdown().await;

    let started = handler.state.started.load(Ordering::SeqCst) as i64;
    assert!(started > 0);
    // Everything started was finished and committed …
    assert_eq!(w.count("select count(*) from effects").await, started);
    assert_eq!(handler.state.in_flight.load(Ordering::SeqCst), 0);
    // … and acked: what is left for the durable is exactly what was never started.
    assert_eq!(w.outstanding("shutdown").await, 4 - started as u64);
}

#[tokio::test]
async fn retention_prunes_old_rows_and_refuses_a_window_shorter_than_redelivery() {
    let w = world("INBOX_RETENTION").await;
    sqlx::query(
        "insert into inbox_events (consumer, event_id, event_type, subject, event_time, handled_at)
         select c, gen_random_uuid(), 't.ok', 's', now(), now() - make_interval(days => d)
           from (values ('ret', 30), ('ret', 20), ('ret', 1), ('other', 30)) as v(c, d)",
    )
    .execute(&w.db.pool)
    .await
    .unwrap();
    let deleted = Retention::default()
        .batch_size(1)
        .prune(&w.db.pool, "ret")
        .await
        .unwrap();
    assert_eq!(deleted, 2);
    assert_eq!(
        w.count("select count(*) from inbox_events where consumer = 'ret'")
            .await,
        1
    );
    assert_eq!(
        w.count("select count(*) from inbox_events where consumer = 'other'")
            .await,
        1
    );

    let short = ConsumerConfig::new(&w.stream, "ret")
        .ack_wait(Duration::from_secs(30))
        .max_deliver(10)
        .retention(Retention::default().window(Duration::from_secs(60)));
    let err = Consumer::new(w.db.pool.clone(), w.js.clone(), short)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("redelivery"), "{err}");
}

#[tokio::test]
async fn the_consumer_carries_on_after_a_broker_restart() {
    let mut w = world("INBOX_BROKER").await;
    let Some(_) = w._nats.server() else {
        return; // NATS_URL points at a server this test cannot restart
    };
    let running = start(
        &w,
        config(&w, "broker"),
        stack(&w.db.pool, Record::new("a")),
    )
    .await;
    w.publish(&event("t.ok", "sub_1", json!({"seq": 1}))).await;
    w.wait_count("first effect", "select count(*) from effects", 1)
        .await;

    let server = w._nats.server().unwrap();
    server.kill().unwrap();
    server.start_again().unwrap();

    let second = event("t.ok", "sub_2", json!({"seq": 2}));
    wait_until("publish after restart", WAIT, || async {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", second.id().to_string().as_str());
        match w
            .js
            .publish_with_headers("t.ok", headers, second.to_json().unwrap().into())
            .await
        {
            Ok(ack) => tokio::time::timeout(Duration::from_secs(2), ack)
                .await
                .is_ok_and(|r| r.is_ok()),
            Err(_) => false,
        }
    })
    .await
    .unwrap();
    w.wait_count("second effect", "select count(*) from effects", 2)
        .await;
    w.wait_settled("broker").await;
    running.shutdown().await;
}

// ---------------------------------------------------------------------------
// SkipStale by `sequence`, driven by hand (no broker), one delivery at a time
// in the order each test picks: dedupe → SkipStale → a handler recording the
// payload's `seq` of every event it applies.

type BySequenceStack = Dedupe<inbox_consumer::SkipStale<HandlerService<Record>>>;

struct BySequence {
    db: TestDb,
    handler: Record,
    stack: BySequenceStack,
}

impl BySequence {
    const CONSUMER: &'static str = "by_sequence";

    async fn new() -> Self {
        let db = TestDb::new().await.unwrap();
        create_effects(&db.pool).await;
        let handler = Record::new("a");
        let stack = Dedupe::new(
            inbox_consumer::SkipStale::new(HandlerService::new(handler.clone())),
            db.pool.clone(),
        );
        Self { db, handler, stack }
    }

    /// Hands `event` to the stack as a first delivery to [`Self::CONSUMER`].
    async fn try_deliver(
        &self,
        event: &Envelope<Value>,
    ) -> Result<Outcome, inbox_consumer::BoxError> {
        let info = inbox_consumer::DeliveryInfo::new(Self::CONSUMER);
        self.stack
            .clone()
            .oneshot(Delivery::new(event.clone(), info))
            .await
    }

    async fn deliver(&self, event: &Envelope<Value>) -> Outcome {
        self.try_deliver(event).await.unwrap()
    }

    /// The payload `seq` of every applied event, in the order applied.
    async fn applied(&self) -> Vec<i64> {
        sqlx::query_scalar("select seq from effects order by n")
            .fetch_all(&self.db.pool)
            .await
            .unwrap()
    }

    /// `inbox_events.sequence` of `event`'s row; `None` if there is no row.
    async fn stored_sequence(&self, event: &Envelope<Value>) -> Option<Option<i64>> {
        sqlx::query_scalar(
            "select sequence from inbox_events where consumer = $1 and event_id = $2",
        )
        .bind(Self::CONSUMER)
        .bind(event.id().as_uuid())
        .fetch_optional(&self.db.pool)
        .await
        .unwrap()
    }
}

/// An event of subject `sub_1` whose payload `seq` is `n`, stamped `time`.
fn event_at(n: i64, time: chrono::DateTime<chrono::Utc>) -> Envelope<Value> {
    event("t.ok", "sub_1", json!({"seq": n})).with_time(time)
}

fn year_2099() -> chrono::DateTime<chrono::Utc> {
    "2099-01-01T00:00:00Z".parse().unwrap()
}

#[tokio::test]
async fn a_later_sequence_is_applied_though_its_time_is_earlier() {
    let s = BySequence::new().await;
    let now = chrono::Utc::now();
    // A producer clock far ahead: under the time rule this event would
    // silence its subject until 2099.
    let ahead = event_at(1, year_2099()).with_sequence(41);
    let next = event_at(2, now).with_sequence(42);
    assert_eq!(s.deliver(&ahead).await, Outcome::Handled);
    assert_eq!(s.deliver(&next).await, Outcome::Handled);
    assert_eq!(s.applied().await, vec![1, 2]);
    assert_eq!(s.stored_sequence(&ahead).await, Some(Some(41)));
    assert_eq!(s.stored_sequence(&next).await, Some(Some(42)));
}

#[tokio::test]
async fn a_lower_sequence_is_stale_though_its_time_is_later() {
    let s = BySequence::new().await;
    let now = chrono::Utc::now();
    let newer = event_at(2, now).with_sequence(42);
    let older = event_at(1, now + chrono::Duration::hours(1)).with_sequence(41);
    assert_eq!(s.deliver(&newer).await, Outcome::Handled);
    assert_eq!(s.deliver(&older).await, Outcome::Stale);
    assert_eq!(
        s.applied().await,
        vec![2],
        "the older event was not applied"
    );
    // The stale event's inbox row commits all the same.
    assert_eq!(s.stored_sequence(&older).await, Some(Some(41)));
    assert_eq!(s.handler.attempts(&older), 0);
}

#[tokio::test]
async fn an_equal_sequence_is_applied() {
    // Two events with one sequence can only come from two outbox databases,
    // whose sequences are not comparable: neither is skipped.
    let s = BySequence::new().await;
    let now = chrono::Utc::now();
    let first = event_at(1, now).with_sequence(42);
    let other = event_at(2, now - chrono::Duration::hours(1)).with_sequence(42);
    assert_eq!(s.deliver(&first).await, Outcome::Handled);
    assert_eq!(s.deliver(&other).await, Outcome::Handled);
    assert_eq!(s.applied().await, vec![1, 2]);
}

#[tokio::test]
async fn events_without_a_sequence_keep_the_time_rule() {
    let s = BySequence::new().await;
    let t0 = chrono::Utc::now();
    let first = event_at(1, t0);
    let earlier = event_at(2, t0 - chrono::Duration::seconds(5));
    let same_time = event_at(3, t0);
    let later = event_at(4, t0 + chrono::Duration::seconds(1));
    assert_eq!(s.deliver(&first).await, Outcome::Handled);
    assert_eq!(s.deliver(&earlier).await, Outcome::Stale);
    assert_eq!(
        s.deliver(&same_time).await,
        Outcome::Handled,
        "equal times are applied"
    );
    assert_eq!(s.deliver(&later).await, Outcome::Handled);
    assert_eq!(s.applied().await, vec![1, 3, 4]);
    assert_eq!(
        s.stored_sequence(&first).await,
        Some(None),
        "no sequence is NULL"
    );
}

#[tokio::test]
async fn a_subject_with_and_without_sequences_compares_like_with_like() {
    let s = BySequence::new().await;
    let t0 = chrono::Utc::now();
    let unsequenced_ahead = event_at(1, year_2099());
    let sequenced = event_at(2, t0).with_sequence(7);
    let sequenced_older = event_at(3, t0 + chrono::Duration::hours(1)).with_sequence(6);
    let unsequenced_now = event_at(4, t0 + chrono::Duration::minutes(30));
    let unsequenced_later = event_at(5, year_2099() + chrono::Duration::days(1));
    assert_eq!(s.deliver(&unsequenced_ahead).await, Outcome::Handled);
    // Applied events without a sequence never make one with a sequence stale.
    assert_eq!(s.deliver(&sequenced).await, Outcome::Handled);
    assert_eq!(s.deliver(&sequenced_older).await, Outcome::Stale);
    // Without a sequence, the time of every recorded event counts: 2099 is later.
    assert_eq!(s.deliver(&unsequenced_now).await, Outcome::Stale);
    assert_eq!(s.deliver(&unsequenced_later).await, Outcome::Handled);
    assert_eq!(s.applied().await, vec![1, 2, 5]);
}

#[tokio::test]
async fn a_scheduled_event_published_after_later_immediate_ones_is_never_stale() {
    // Scheduled for its due time, written before events 2 and 3 of its
    // subject (a lower seq, an earlier time), published after them: it
    // carries `scheduledfor` and no sequence, and is applied.
    let s = BySequence::new().await;
    let t0 = chrono::Utc::now();
    let second = event_at(2, t0).with_sequence(42);
    let third = event_at(3, t0 + chrono::Duration::seconds(1)).with_sequence(43);
    let scheduled = event_at(1, t0 - chrono::Duration::days(14))
        .with_scheduled_for(t0 + chrono::Duration::seconds(2));
    assert_eq!(s.deliver(&second).await, Outcome::Handled);
    assert_eq!(s.deliver(&third).await, Outcome::Handled);
    assert_eq!(s.deliver(&scheduled).await, Outcome::Handled);
    assert_eq!(s.applied().await, vec![2, 3, 1]);
    // Nor does it make a later immediate event stale, nor one of its own kind.
    let fourth = event_at(4, t0 + chrono::Duration::seconds(3)).with_sequence(44);
    assert_eq!(s.deliver(&fourth).await, Outcome::Handled);
    let another = event_at(5, t0 - chrono::Duration::days(30))
        .with_scheduled_for(t0 - chrono::Duration::days(1));
    assert_eq!(s.deliver(&another).await, Outcome::Handled);
    assert_eq!(s.applied().await, vec![2, 3, 1, 4, 5]);
    // A redelivery of it is a duplicate, as for any event.
    assert_eq!(s.deliver(&scheduled).await, Outcome::Duplicate);
}

#[tokio::test]
async fn a_duplicate_of_a_stale_event_is_a_duplicate() {
    let s = BySequence::new().await;
    let now = chrono::Utc::now();
    let newer = event_at(2, now - chrono::Duration::minutes(1)).with_sequence(2);
    let older = event_at(1, now).with_sequence(1);
    assert_eq!(s.deliver(&newer).await, Outcome::Handled);
    assert_eq!(s.deliver(&older).await, Outcome::Stale);
    assert_eq!(s.deliver(&older).await, Outcome::Duplicate);
    assert_eq!(s.deliver(&newer).await, Outcome::Duplicate);
    assert_eq!(s.applied().await, vec![2]);
    assert_eq!(
        s.handler.attempts(&older),
        0,
        "the handler never saw the stale event"
    );
    assert_eq!(
        s.stored_sequence(&older).await,
        Some(Some(1)),
        "one inbox row per event"
    );
}

#[tokio::test]
async fn a_sequence_above_i64_max_is_refused_before_anything_is_written() {
    let s = BySequence::new().await;
    let now = chrono::Utc::now();
    for too_high in [i64::MAX as u64 + 1, u64::MAX] {
        let event = event_at(1, now).with_sequence(too_high);
        let err = s.try_deliver(&event).await.unwrap_err();
        let err = err.downcast_ref::<inbox_consumer::Error>().unwrap();
        assert_eq!(err.kind(), ErrorKind::InvalidEnvelope, "{err}");
        assert!(err.to_string().contains(&too_high.to_string()), "{err}");
        assert_eq!(s.stored_sequence(&event).await, None, "no inbox row");
    }
    let highest = event_at(2, now).with_sequence(i64::MAX as u64);
    assert_eq!(s.deliver(&highest).await, Outcome::Handled);
    assert_eq!(s.stored_sequence(&highest).await, Some(Some(i64::MAX)));
    assert_eq!(s.applied().await, vec![2]);
}

#[tokio::test]
async fn the_runtime_dead_letters_an_event_whose_sequence_is_above_i64_max() {
    let w = world("INBOX_SEQ_TOO_HIGH").await;
    let running = start(
        &w,
        config(&w, "seq_too_high"),
        stack(&w.db.pool, Record::new("a")),
    )
    .await;
    w.publish(&event("t.ok", "sub_1", json!({"seq": 1})).with_sequence(u64::MAX))
        .await;
    w.publish(&event("t.ok", "sub_1", json!({"seq": 2})).with_sequence(1))
        .await;
    w.wait_count("the next event's effect", "select count(*) from effects", 1)
        .await;
    w.wait_settled("seq_too_high").await;
    assert_eq!(
        w.count("select count(*) from inbox_dead_letters where reason = 'not_cloudevent'")
            .await,
        1
    );
    assert_eq!(w.count("select count(*) from inbox_events").await, 1);
    assert_eq!(w.count("select seq from effects").await, 2);
    running.shutdown().await;
}

#[tokio::test]
async fn last_applied_sequence_skips_the_event_itself_and_rows_without_one() {
    use inbox_consumer::ordering::last_applied_sequence;

    let db = TestDb::new().await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let (mine, other, unsequenced) = (
        event("t.ok", "s", json!({})),
        event("t.ok", "s", json!({})),
        event("t.ok", "s", json!({})),
    );
    let insert =
        "insert into inbox_events (consumer, event_id, event_type, subject, event_time, sequence)
                  values ($1, $2, 't.ok', 's', now(), $3)";
    for (consumer, e, seq) in [
        ("c", &unsequenced, None),
        ("c", &mine, Some(9_i64)),
        ("other_consumer", &other, Some(100)),
    ] {
        sqlx::query(insert)
            .bind(consumer)
            .bind(e.id().as_uuid())
            .bind(seq)
            .execute(&mut *conn)
            .await
            .unwrap();
    }
    assert_eq!(
        last_applied_sequence(&mut conn, "c", "s", mine.id())
            .await
            .unwrap(),
        None,
        "only the event itself and a row without a sequence"
    );
    assert_eq!(
        last_applied_sequence(&mut conn, "c", "s", other.id())
            .await
            .unwrap(),
        Some(9)
    );
    assert_eq!(
        last_applied_sequence(&mut conn, "c", "other_subject", other.id())
            .await
            .unwrap(),
        None
    );

    // The question reads the partial index (forced: the table is tiny).
    sqlx::query("set enable_seqscan = off")
        .execute(&mut *conn)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "explain {}",
        include_str!("../../../inbox-consumer/queries/last_applied_sequence.sql")
    )))
    .bind("c")
    .bind("s")
    .bind(other.id().as_uuid())
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    assert!(
        plan.iter()
            .any(|l| l.contains("inbox_events_subject_sequence_idx")),
        "{plan:#?}"
    );
}

#[tokio::test]
async fn the_inbox_sequence_migration_is_idempotent_and_keeps_sequences_unsigned() {
    let db = TestDb::new().await.unwrap();
    // Applied once by TestDb; again, as by hand, changes nothing.
    sqlx::raw_sql(include_str!(
        "../../../migrations/20260101000006_inbox_sequence.sql"
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let (data_type, nullable): (String, String) = sqlx::query_as(
        "select data_type::text, is_nullable::text from information_schema.columns
          where table_schema = current_schema() and table_name = 'inbox_events'
            and column_name = 'sequence'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((data_type.as_str(), nullable.as_str()), ("bigint", "YES"));
    let checks: i64 = sqlx::query_scalar(
        "select count(*) from pg_constraint
          where conrelid = 'inbox_events'::regclass and contype = 'c'
            and pg_get_constraintdef(oid) like '%sequence%'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(checks, 1, "the rerun added no second check");
    let index: String = sqlx::query_scalar(
        "select indexdef::text from pg_indexes
          where tablename = 'inbox_events' and indexname = 'inbox_events_subject_sequence_idx'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        index.contains("(consumer, subject, sequence DESC)")
            && index.contains("WHERE (sequence IS NOT NULL)"),
        "{index}"
    );

    let err = sqlx::query(
        "insert into inbox_events (consumer, event_id, event_type, subject, event_time, sequence)
         values ('c', gen_random_uuid(), 't.ok', 's', now(), -1)",
    )
    .execute(&db.pool)
    .await
    .unwrap_err();
    assert_eq!(
        err.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("23514"),
        "a check violation: {err}"
    );
}
