//! The inbox runtime's promises under load and contention, against real
//! PostgreSQL and nats-server:
//!
//! - batched handling: one effect per event through duplicates, a handler
//!   that fails once (retried alone), and a crash between a batch's commit
//!   and its acks (redelivered, then deduped);
//! - every held message keeps its ack deadline: a handler slower than
//!   `ack_wait`, with messages queued behind its subject and behind the one
//!   slot, causes no redelivery; with the default ack wait, a handler
//!   running three ack waits is handled once, and a durable created with the
//!   30 s ack wait of earlier versions takes the default at start;
//! - a lock wait that times out (an inbox row held by a frozen transaction)
//!   is retried without spending the delivery budget, and the broker's own
//!   delivery limit is unlimited;
//! - a type no route handles is acked and counted, not dead-lettered.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use inbox_consumer::runtime::DEFAULT_ACK_WAIT;
use inbox_consumer::{
    BatchResults, BoxError, ConsumerConfig, DedupeLayer, Delivery, DeliveryInfo, HandlerService,
    MetricsLayer, Outcome, Router, Timeouts, TraceLayer,
};
use outbox_pg::EventId;
use outbox_testkit::wait_until;
use serde_json::json;
use tokio::sync::Notify;
use tower::{Service, ServiceBuilder};

use super::world::*;

// ---------------------------------------------------------------------------
// A batch service wrapper that records what it was given and answered, and
// can hang after its first committed batch (a process dying before its acks).

/// One call: the events of the batch and what each came back as.
type Call = Vec<(EventId, Option<Outcome>)>;

#[derive(Default)]
struct Seen {
    calls: Mutex<Vec<Call>>,
    hang_after_first_commit: Mutex<bool>,
    hung: Notify,
}

#[derive(Clone)]
struct Watch<S> {
    inner: S,
    seen: Arc<Seen>,
}

impl<S> Service<Vec<Delivery>> for Watch<S>
where
    S: Service<Vec<Delivery>, Response = BatchResults, Error = BoxError> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = BatchResults;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<BatchResults, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, batch: Vec<Delivery>) -> Self::Future {
        let ids: Vec<EventId> = batch.iter().map(Delivery::id).collect();
        let seen = Arc::clone(&self.seen);
        let call = self.inner.call(batch);
        Box::pin(async move {
            let results = call.await?;
            let outcomes = ids
                .iter()
                .zip(&results)
                .map(|(id, r)| (*id, r.as_ref().ok().copied()))
                .collect();
            seen.calls.lock().unwrap().push(outcomes);
            let hang = std::mem::take(&mut *seen.hang_after_first_commit.lock().unwrap());
            if hang && results.iter().any(|r| matches!(r, Ok(Outcome::Handled))) {
                seen.hung.notify_one();
                std::future::pending::<()>().await;
            }
            Ok(results)
        })
    }
}

type BatchStack = Watch<Stack>;

fn batch_stack(w: &World, handler: Record, seen: &Arc<Seen>) -> BatchStack {
    Watch {
        inner: stack(&w.db.pool, handler),
        seen: Arc::clone(seen),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn batches_give_one_effect_per_event_through_duplicates_a_failure_and_a_crash_before_the_acks()
 {
    const EVENTS: usize = 1_000;
    let w = world("INBOX_BATCH").await;
    let handler = Record::new("a");
    let config = config(&w, "batch")
        .ack_wait(Duration::from_secs(2))
        .max_batch(64)
        .concurrency(4)
        .max_buffered(512);

    let mut events = Vec::with_capacity(EVENTS);
    for i in 0..EVENTS - 1 {
        events.push(event("t.ok", &format!("sub_{i}"), json!({"seq": i})));
    }
    let failing = event(
        "t.ok",
        "sub_failing",
        json!({"seq": EVENTS, "mode": "fail_once"}),
    );
    events.push(failing.clone());
    w.publish_all(&events).await;
    // 100 copies re-sent with new message ids: stored in the stream again.
    for (i, e) in events.iter().step_by(10).enumerate() {
        w.publish_raw("t.ok", e.to_json().unwrap(), &format!("again-{i}"))
            .await;
    }

    // The first run hangs after its first committed batch, before the acks,
    // and is then dropped: a crash between commit and ack.
    let seen = Arc::new(Seen::default());
    *seen.hang_after_first_commit.lock().unwrap() = true;
    let crashed = start_batched(&w, config.clone(), batch_stack(&w, handler.clone(), &seen)).await;
    tokio::time::timeout(WAIT, seen.hung.notified())
        .await
        .expect("a first batch committed");
    crashed.task.abort();
    let committed_unacked: Vec<EventId> = seen.calls.lock().unwrap()[0]
        .iter()
        .filter(|(_, o)| *o == Some(Outcome::Handled))
        .map(|(id, _)| *id)
        .collect();
    assert!(!committed_unacked.is_empty());

    let seen = Arc::new(Seen::default());
    let running = start_batched(&w, config, batch_stack(&w, handler.clone(), &seen)).await;
    wait_until("every event has its effect", WAIT * 3, || async {
        w.count("select count(distinct event_id) from effects")
            .await
            == EVENTS as i64
    })
    .await
    .unwrap();
    w.wait_settled("batch").await;
    running.shutdown().await;

    assert_eq!(
        w.count("select count(*) from effects").await,
        EVENTS as i64,
        "one effect per event"
    );
    assert_eq!(w.count("select count(*) from inbox_dead_letters").await, 0);
    let calls = seen.calls.lock().unwrap().clone();
    let outcome_of: HashMap<EventId, Vec<(usize, Option<Outcome>)>> =
        calls.iter().fold(HashMap::new(), |mut map, call| {
            for (id, outcome) in call {
                map.entry(*id).or_default().push((call.len(), *outcome));
            }
            map
        });
    // The batch the crashed run committed came back, and was a duplicate.
    for id in &committed_unacked {
        assert!(
            outcome_of[id]
                .iter()
                .all(|(_, o)| *o == Some(Outcome::Duplicate)),
            "{id}: {:?}",
            outcome_of[id]
        );
    }
    // The failing handler ran twice: it failed in its batch, then alone.
    assert_eq!(handler.attempts(&failing), 2);
    let failing_calls = &outcome_of[&failing.id()];
    assert!(
        failing_calls.contains(&(1, Some(Outcome::Handled))),
        "retried alone: {failing_calls:?}"
    );
    assert!(
        failing_calls
            .iter()
            .any(|(size, o)| *size > 1 && o.is_none()),
        "failed inside a batch: {failing_calls:?}"
    );
    // Deliveries were handled many at a time.
    let largest = calls.iter().map(Vec::len).max().unwrap_or(0);
    assert!(largest >= 32, "largest batch {largest}");
    // The re-sent copies were duplicates, never second effects.
    let duplicates: HashSet<EventId> = calls
        .iter()
        .flatten()
        .filter(|(_, o)| *o == Some(Outcome::Duplicate))
        .map(|(id, _)| *id)
        .collect();
    assert!(duplicates.len() >= 100, "{} duplicates", duplicates.len());
}

// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_handler_slower_than_ack_wait_gets_no_redelivery_of_what_waits_behind_it() {
    let w = world("INBOX_SLOW").await;
    let handler = Record::new("a");
    // One slot, two subjects, three events each, 1.2 s per event: the last
    // waits about 6 s in the runtime, six ack waits.
    let config = config(&w, "slow")
        .ack_wait(Duration::from_secs(1))
        .concurrency(1);
    let running = start(&w, config, stack(&w.db.pool, handler.clone())).await;
    let events: Vec<_> = (0..6)
        .map(|i| {
            event(
                "t.ok",
                &format!("slow_{}", i % 2),
                json!({"seq": i, "mode": "slower"}),
            )
        })
        .collect();
    w.publish_all(&events).await;
    wait_until("all six handled", Duration::from_secs(30), || async {
        w.count("select count(*) from effects").await == 6
    })
    .await
    .unwrap();
    w.wait_settled("slow").await;
    running.shutdown().await;
    for e in &events {
        assert_eq!(handler.attempts(e), 1, "{} handled once", e.id());
    }
    let stream = w.js.get_stream(&w.stream).await.unwrap();
    let info = stream.consumer_info("slow").await.unwrap();
    assert_eq!(info.num_redelivered, 0, "no message was redelivered");
    assert_eq!(info.delivered.consumer_sequence, 6, "six deliveries in all");
}

// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn with_the_default_ack_wait_a_handler_running_three_ack_waits_is_handled_once() {
    let w = world("INBOX_SLEEPY").await;
    // A durable left by an earlier version, with its 30 s ack wait.
    let stream = w.js.get_stream(&w.stream).await.unwrap();
    stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("sleepy".into()),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .unwrap();
    let handler = Record::new("a");
    // Every default but the slots: one, so that the second subject's event
    // waits behind the first for the whole sleep.
    let config = ConsumerConfig::new(&w.stream, "sleepy").concurrency(1);
    let running = start(&w, config, stack(&w.db.pool, handler.clone())).await;
    let info = stream.consumer_info("sleepy").await.unwrap();
    assert_eq!(
        info.config.ack_wait, DEFAULT_ACK_WAIT,
        "the existing durable was updated to the default ack wait"
    );
    let sleep = DEFAULT_ACK_WAIT * 3;
    let ms = u64::try_from(sleep.as_millis()).unwrap();
    let events = vec![
        event(
            "t.ok",
            "sleepy_1",
            json!({"seq": 1, "mode": {"sleep_ms": ms}}),
        ),
        event("t.ok", "sleepy_2", json!({"seq": 2})),
        event("t.ok", "sleepy_1", json!({"seq": 3})),
    ];
    let published = std::time::Instant::now();
    w.publish_all(&events).await;
    wait_until("all three handled", sleep + WAIT, || async {
        w.count("select count(*) from effects").await == 3
    })
    .await
    .unwrap();
    let took = published.elapsed();
    w.wait_settled("sleepy").await;
    running.shutdown().await;
    assert!(took >= sleep, "the sleeping handler ran {took:?}");
    for e in &events {
        assert_eq!(handler.attempts(e), 1, "{} handled once", e.id());
    }
    let info = stream.consumer_info("sleepy").await.unwrap();
    assert_eq!(info.num_redelivered, 0, "no message was redelivered");
    assert_eq!(
        info.delivered.consumer_sequence, 3,
        "three deliveries in all"
    );
}

// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_lock_wait_that_times_out_is_retried_without_spending_the_budget() {
    let w = world("INBOX_LOCKED").await;
    let handler = Record::new("a");
    let e = event("t.ok", "locked", json!({"seq": 1}));
    // A transaction of a frozen replica holds the event's inbox row.
    let mut frozen = w.db.pool.begin().await.unwrap();
    sqlx::query(
        "insert into inbox_events (consumer, event_id, event_type, subject, event_time)
         values ('locked', $1, 't.ok', 'locked', now())",
    )
    .bind(e.id().as_uuid())
    .execute(&mut *frozen)
    .await
    .unwrap();

    let stack = ServiceBuilder::new()
        .layer(TraceLayer::new())
        .layer(MetricsLayer::new())
        .layer(
            DedupeLayer::new(w.db.pool.clone())
                .timeouts(Timeouts::default().lock(Duration::from_millis(200))),
        )
        .service(Router::new().route("t.ok", HandlerService::new(handler.clone())));
    let config = config(&w, "locked").max_deliver(2);
    let running = start(&w, config, stack).await;
    let stream = w.js.get_stream(&w.stream).await.unwrap();
    let info = stream.consumer_info("locked").await.unwrap();
    assert_eq!(info.config.max_deliver, -1, "the broker never gives up");

    w.publish(&e).await;
    wait_until(
        "delivered past the budget of 2 while the row is locked",
        WAIT,
        || async {
            let info = stream.consumer_info("locked").await.unwrap();
            info.delivered.consumer_sequence >= 4
        },
    )
    .await
    .unwrap();
    assert_eq!(w.count("select count(*) from inbox_dead_letters").await, 0);
    assert_eq!(handler.attempts(&e), 0, "the handler never ran");

    // The frozen transaction ends (the server would end it after the
    // idle-in-transaction timeout): the next delivery is handled.
    frozen.rollback().await.unwrap();
    w.wait_count("the effect", "select count(*) from effects", 1)
        .await;
    w.wait_settled("locked").await;
    running.shutdown().await;
    assert_eq!(w.count("select count(*) from effects").await, 1);
    assert_eq!(w.count("select count(*) from inbox_dead_letters").await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_idle_transaction_is_ended_by_the_server_after_its_timeout() {
    let w = world("INBOX_IDLE").await;
    let timeouts = Timeouts::default().idle_in_transaction(Duration::from_millis(300));
    let stack = ServiceBuilder::new()
        .layer(DedupeLayer::new(w.db.pool.clone()).timeouts(timeouts))
        .service(Router::new().route("t.ok", HandlerService::new(Record::new("a"))));
    // A handler that stalls between statements (as in a frozen process) past
    // the timeout: the server ends its transaction, releasing its locks, and
    // the delivery fails instead of holding them.
    let e = event("t.ok", "idle", json!({"seq": 1, "mode": "stall"}));
    let delivery = Delivery::new(e, DeliveryInfo::new("idle"));
    let result = tower::ServiceExt::oneshot(stack, delivery).await;
    assert!(result.is_err(), "{result:?}");
    assert_eq!(w.count("select count(*) from inbox_events").await, 0);
    assert_eq!(w.count("select count(*) from effects").await, 0);
}

// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_type_no_route_handles_is_acked_and_counted_not_dead_lettered() {
    let w = world("INBOX_UNROUTED").await;
    let handler = Record::new("a");
    let running = start(
        &w,
        config(&w, "unrouted"),
        stack(&w.db.pool, handler.clone()),
    )
    .await;
    w.publish(&event("t.unknown", "u", json!({"seq": 1}))).await;
    w.publish(&event("t.ok", "u", json!({"seq": 2}))).await;
    w.wait_count(
        "the routed event's effect",
        "select count(*) from effects",
        1,
    )
    .await;
    w.wait_settled("unrouted").await;
    running.shutdown().await;
    assert_eq!(w.count("select count(*) from inbox_dead_letters").await, 0);
    assert_eq!(counter("inbox_unrouted_total", "unrouted"), 1);
}

// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn a_message_is_dead_lettered_once_even_when_its_term_was_lost() {
    let w = world("INBOX_DL_ONCE").await;
    let poison = b"\x00 not json".to_vec();
    let seq_of =
        |ack: async_nats::jetstream::publish::PublishAck| i64::try_from(ack.sequence).unwrap();
    let first = seq_of(
        w.js.publish("t.ok", poison.clone().into())
            .await
            .unwrap()
            .await
            .unwrap(),
    );
    let other = seq_of(
        w.js.publish("t.ok", b"also not json".to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap(),
    );
    // An earlier delivery of `first` wrote its dead letter and its Term was
    // lost. For `other`'s sequence there is a row with different bytes: a
    // stream of the same name, created again, numbering from 1 again.
    let earlier = "insert into inbox_dead_letters
        (consumer, stream, stream_sequence, subject, delivery_count, reason, error, payload)
        values ('dl_once', $1, $2, 't.ok', 1, 'not_json', 'earlier', $3)";
    for (seq, payload) in [(first, poison.clone()), (other, b"older bytes".to_vec())] {
        sqlx::query(earlier)
            .bind(&w.stream)
            .bind(seq)
            .bind(payload)
            .execute(&w.db.pool)
            .await
            .unwrap();
    }

    let running = start(
        &w,
        config(&w, "dl_once"),
        stack(&w.db.pool, Record::new("a")),
    )
    .await;
    w.wait_settled("dl_once").await;
    running.shutdown().await;
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "select stream_sequence, error from inbox_dead_letters order by stream_sequence, id",
    )
    .fetch_all(&w.db.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert_eq!(rows[0], (first, "earlier".to_owned()), "not written twice");
    assert_eq!(rows[1].0, other);
    assert_eq!(rows[2].0, other);
    assert_ne!(
        rows[2].1, "earlier",
        "a different message at that sequence is kept"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_that_arrives_while_the_consumer_shuts_down_is_not_left_unacked() {
    let w = world("INBOX_STOPPING").await;
    let handler = Record::new("a");
    // A long ack wait: a message delivered to a consumer that stopped reading
    // would sit out 60 s.
    let stopping = config(&w, "stopping").ack_wait(Duration::from_secs(60));
    let mut running = start(&w, stopping.clone(), stack(&w.db.pool, handler.clone())).await;
    w.publish(&event("t.ok", "warm", json!({"seq": 0}))).await;
    w.wait_count("the warm-up handled", "select count(*) from effects", 1)
        .await;

    // Shutdown begins while a pull is open; an event arrives right after.
    let _ = running.stop.take().unwrap().send(());
    w.publish(&event("t.ok", "late", json!({"seq": 1}))).await;
    tokio::time::timeout(WAIT, &mut running.task)
        .await
        .expect("shutdown finishes")
        .unwrap()
        .unwrap();
    // Handled before the exit, or given back: a consumer started again gets
    // it well within the 60 s ack wait, and handles it once.
    let mut again = start(&w, stopping, stack(&w.db.pool, handler.clone())).await;
    w.wait_count("the late event handled", "select count(*) from effects", 2)
        .await;
    let _ = again.stop.take().unwrap().send(());
    tokio::time::timeout(WAIT, &mut again.task)
        .await
        .expect("shutdown finishes")
        .unwrap()
        .unwrap();
    assert_eq!(w.count("select count(*) from effects").await, 2);
    let stream = w.js.get_stream(&w.stream).await.unwrap();
    let info = stream.consumer_info("stopping").await.unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
}
