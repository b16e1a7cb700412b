//! A [`BatchHandler`](inbox_consumer::BatchHandler), against real PostgreSQL
//! and nats-server: the events of its type in a batch reach it in one call,
//! and a failure in a group is pinned on its event.
//!
//! With a backlog published before the consumer starts (so batches fill), in
//! batched mode and in ordered batched mode:
//!
//! - groups of more than one event are formed, duplicates (the same event
//!   published again under another message id) never reach the handler, and
//!   every event is applied once;
//! - a group holding an event that fails once, one the handler rejects and
//!   one on which it panics rolls back as a whole; each of its deliveries is
//!   then handled alone: the one that failed once is applied on its retry,
//!   the rejected one is dead-lettered `rejected`, the panicking one `panic`
//!   once its budget is spent, and every other event is applied exactly once;
//!   ordered, the later events of those subjects wait for them;
//! - with a service between the dedupe and the router, no group is formed:
//!   each event reaches the handler alone, still several per transaction.

use std::time::Duration;

use serde_json::json;

use super::world::*;

/// The delivery budget of these tests.
const BUDGET: i64 = 3;

async fn groups_and_failures(ordered: bool, durable: &str) {
    let w = world(&format!("BATCH_HANDLER_{}", durable.to_uppercase())).await;
    let handler = Record::new("a");

    // The backlog first, so the consumer's first pulls bring full batches.
    let plain: Vec<_> = (0..60).map(|i| ok(&format!("plain_{i}"), 1)).collect();
    let fails_once = event("t.ok", "fails_once", json!({"seq": 1, "mode": "fail_once"}));
    let rejected = event("t.ok", "rejected", json!({"seq": 1, "mode": "reject"}));
    let panicking = event("t.ok", "panicking", json!({"seq": 1, "mode": "panic"}));
    // A later event of each failing subject: ordered, it waits for the first.
    let later: Vec<_> = ["fails_once", "rejected", "panicking"]
        .iter()
        .map(|subject| ok(subject, 2))
        .collect();
    let mut events = plain[..30].to_vec();
    events.extend([fails_once.clone(), rejected.clone(), panicking.clone()]);
    events.extend(plain[30..].iter().cloned());
    events.extend(later.iter().cloned());
    w.publish_all(&events).await;
    // Duplicates of ten events, under message ids of their own.
    for e in &plain[..10] {
        w.publish_raw("t.ok", e.to_json().unwrap(), &format!("again-{}", e.id()))
            .await;
    }

    let mut config = config(&w, durable)
        .max_deliver(BUDGET)
        .concurrency(2)
        .max_batch(16);
    if ordered {
        config = config.ordered(true).lease_timeout(Duration::from_secs(6));
    }
    let running = start_batched(&w, config, batch_stack(&w.db.pool, handler.clone())).await;

    let applied = events.len() as i64 - 2;
    w.wait_count(
        "every event applied but the rejected and the panicking one",
        "select count(*) from effects",
        applied,
    )
    .await;
    w.wait_count(
        "the rejected and the panicking event dead-lettered",
        "select count(*) from inbox_dead_letters",
        2,
    )
    .await;
    w.wait_settled(durable).await;

    let sizes = handler.group_sizes();
    assert!(
        sizes.iter().any(|&n| n > 1),
        "no group of more than one event: {sizes:?}"
    );
    // Every event once, the duplicates included; the failed ones never.
    for e in events
        .iter()
        .filter(|e| e.id() != rejected.id() && e.id() != panicking.id())
    {
        assert_eq!(effects_of(&w, e).await, 1, "{}", e.id());
    }
    assert_eq!(effects_of(&w, &rejected).await, 0);
    assert_eq!(effects_of(&w, &panicking).await, 0);
    let mut reasons: Vec<(String, String)> =
        sqlx::query_as("select reason, event_id::text from inbox_dead_letters order by reason")
            .fetch_all(&w.db.pool)
            .await
            .unwrap();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            ("panic".to_owned(), panicking.id().to_string()),
            ("rejected".to_owned(), rejected.id().to_string()),
        ]
    );
    // A duplicate reaches no group: an event is attempted in its batch and,
    // if that batch rolled back, once more alone, never more.
    for e in &plain[..10] {
        assert!(
            handler.attempts(e) <= 2,
            "{}: {} attempts",
            e.id(),
            handler.attempts(e)
        );
    }
    if ordered {
        // Each failing subject's later event ran after its first was settled.
        let order: Vec<(String, i64)> = sqlx::query_as(
            "select subject, seq from effects
              where subject in ('fails_once', 'rejected', 'panicking') order by n",
        )
        .fetch_all(&w.db.pool)
        .await
        .unwrap();
        let fails_once_order: Vec<i64> = order
            .iter()
            .filter(|(s, _)| s == "fails_once")
            .map(|(_, q)| *q)
            .collect();
        assert_eq!(fails_once_order, [1, 2]);
        let waited = w
            .count(&format!(
                "select count(*) from inbox_events i
                   join (values ('rejected', '{}'::uuid), ('panicking', '{}'::uuid)) v (subject, id)
                     on i.subject = v.subject
                   join inbox_dead_letters d on d.event_id = v.id
                  where i.consumer = '{durable}' and i.handled_at >= d.created_at",
                rejected.id(),
                panicking.id(),
            ))
            .await;
        assert_eq!(
            waited, 2,
            "a later event ran before its subject's dead letter"
        );
    }
    assert!(!running.task.is_finished(), "the runtime exited");
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_handler_gets_groups_and_a_failure_is_pinned_on_its_event() {
    groups_and_failures(false, "batch_handler").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_handler_gets_groups_and_a_failure_is_pinned_on_its_event_ordered() {
    groups_and_failures(true, "batch_handler_ordered").await;
}

/// With a service between the dedupe and the router (here the router boxed),
/// stated to keep no groups ([`Ungrouped`](inbox_consumer::Ungrouped)), no
/// group is formed: each event reaches the handler alone, once.
#[tokio::test(flavor = "multi_thread")]
async fn behind_another_service_a_batch_handler_gets_one_event_at_a_time() {
    use inbox_consumer::{DedupeLayer, InTx, MetricsLayer, Outcome, Router, TraceLayer, Ungrouped};
    use tower::ServiceBuilder;
    use tower::util::BoxCloneSyncService;

    let durable = "batch_handler_boxed";
    let w = world("BATCH_HANDLER_BOXED").await;
    let handler = Record::new("a");
    let events: Vec<_> = (0..40).map(|i| ok(&format!("boxed_{i}"), 1)).collect();
    w.publish_all(&events).await;

    let router: BoxCloneSyncService<InTx<inbox_consumer::Delivery>, InTx<Outcome>, _> =
        BoxCloneSyncService::new(Router::new().route_batch_handler("t.ok", handler.clone()));
    let stack = ServiceBuilder::new()
        .layer(TraceLayer::new())
        .layer(MetricsLayer::new())
        .layer(DedupeLayer::new(w.db.pool.clone()))
        .service(Ungrouped::new(router));
    let config = config(&w, durable).concurrency(2).max_batch(16);
    let running = start_batched(&w, config, stack).await;
    w.wait_count(
        "every event applied",
        "select count(*) from effects",
        events.len() as i64,
    )
    .await;
    w.wait_settled(durable).await;
    for e in &events {
        assert_eq!(effects_of(&w, e).await, 1, "{}", e.id());
    }
    let sizes = handler.group_sizes();
    assert_eq!(sizes.len(), events.len(), "{sizes:?}");
    assert!(sizes.iter().all(|&n| n == 1), "{sizes:?}");
    // Still batched: several deliveries per transaction.
    let transactions = w
        .count(&format!(
            "select count(distinct handled_at) from inbox_events where consumer = '{durable}'"
        ))
        .await;
    assert!(
        transactions < events.len() as i64,
        "{transactions} transactions"
    );
    running.shutdown().await;
}
