//! A panicking handler, against real PostgreSQL and nats-server: the panic is
//! the event's failure, not the runtime's. In every mode (one delivery at a
//! time, ordered, batched, ordered and batched), with a handler that panics
//! on one event of a subject:
//!
//! - each panicked attempt rolls back (its effect is gone) and is counted in
//!   `inbox_handler_panics_total`; once the budget (`max_deliver` 3) is spent
//!   the event is dead-lettered with reason `panic`, the panic's message in
//!   its error;
//! - every other event is handled exactly once, and, ordered, the later
//!   events of the panicking event's subject wait until it is dead-lettered;
//! - the runtime never exits: it goes on consuming events published after,
//!   then shuts down cleanly.

use std::time::Duration;

use outbox_testkit::wait_until;
use serde_json::json;
use uuid::Uuid;

use super::world::*;

/// The delivery budget of these tests.
const BUDGET: u64 = 3;

#[derive(Debug, Clone, Copy)]
enum Mode {
    Single,
    Ordered,
    Batched,
    OrderedBatched,
}

impl Mode {
    fn ordered(self) -> bool {
        matches!(self, Self::Ordered | Self::OrderedBatched)
    }

    fn batched(self) -> bool {
        matches!(self, Self::Batched | Self::OrderedBatched)
    }
}

async fn a_panicking_handler_fails_its_event_only(mode: Mode, durable: &str) {
    let w = world(&format!("PANICS_{}", durable.to_uppercase())).await;
    let handler = Record::new("a");
    let mut config = config(&w, durable)
        .max_deliver(i64::try_from(BUDGET).unwrap())
        .concurrency(4);
    if mode.ordered() {
        config = config.ordered(true).lease_timeout(Duration::from_secs(6));
    }
    if mode.batched() {
        config = config.max_batch(8);
    }
    let running = if mode.batched() {
        start_batched(&w, config, stack(&w.db.pool, handler.clone())).await
    } else {
        start(&w, config, stack(&w.db.pool, handler.clone())).await
    };

    // The entity's events: the second panics. Others around it.
    let entity = "entity";
    let before = ok(entity, 1);
    let panicking = event("t.ok", entity, json!({"seq": 2, "mode": "panic"}));
    let after: Vec<_> = (3..6).map(|seq| ok(entity, seq)).collect();
    let others: Vec<_> = (0..12).map(|i| ok(&format!("other_{i}"), i)).collect();
    let mut events = vec![before.clone(), panicking.clone()];
    events.extend(after.iter().cloned());
    events.extend(others.iter().cloned());
    w.publish_all(&events).await;

    wait_until(
        "the panicking event dead-lettered, every other event handled",
        WAIT,
        || async {
            w.count("select count(*) from inbox_dead_letters").await == 1
                && w.count("select count(*) from effects").await == events.len() as i64 - 1
        },
    )
    .await
    .unwrap();
    w.wait_settled(durable).await;

    let (reason, event_id, error): (String, Option<Uuid>, String) =
        sqlx::query_as("select reason, event_id, error from inbox_dead_letters")
            .fetch_one(&w.db.pool)
            .await
            .unwrap();
    assert_eq!(reason, "panic");
    assert_eq!(event_id, Some(*panicking.id().as_uuid()));
    assert!(
        error.contains(PANIC_MESSAGE) && error.contains("panicked"),
        "{error}"
    );
    // Every attempt rolled back; each one alone was counted.
    assert_eq!(effects_of(&w, &panicking).await, 0);
    assert_eq!(counter("inbox_handler_panics_total", durable), BUDGET);
    let attempts = handler.attempts(&panicking) as u64;
    if mode.batched() {
        // Inside a batch, then alone, on each delivery.
        assert!(
            (BUDGET..=2 * BUDGET).contains(&attempts),
            "{attempts} attempts"
        );
    } else {
        assert_eq!(attempts, BUDGET);
    }
    assert_eq!(counter("inbox_dead_lettered_total", durable), 1);
    // Every other event exactly once.
    for e in events.iter().filter(|e| e.id() != panicking.id()) {
        assert_eq!(effects_of(&w, e).await, 1, "{}", e.id());
    }
    if mode.ordered() {
        // The entity's later events waited for the dead letter, then ran in order.
        let waited = w
            .count(&format!(
                "select count(*) from inbox_events i, inbox_dead_letters d
                  where i.consumer = '{durable}' and i.subject = '{entity}'
                    and i.handled_at >= d.created_at"
            ))
            .await;
        assert_eq!(
            waited,
            after.len() as i64,
            "later events ran before the dead letter"
        );
        let order: Vec<i64> =
            sqlx::query_scalar("select seq from effects where subject = $1 order by n")
                .bind(entity)
                .fetch_all(&w.db.pool)
                .await
                .unwrap();
        assert_eq!(order, [1, 3, 4, 5]);
    }

    // The runtime goes on: events published now are handled.
    assert!(!running.task.is_finished(), "the runtime exited");
    let later = [ok(entity, 6), ok("latecomer", 1)];
    w.publish_all(&later).await;
    w.wait_count(
        "the events published after",
        "select count(*) from effects",
        events.len() as i64 + 1,
    )
    .await;
    w.wait_settled(durable).await;
    for e in &later {
        assert_eq!(effects_of(&w, e).await, 1, "{}", e.id());
    }
    assert_eq!(counter("inbox_handler_panics_total", durable), BUDGET);
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_handler_is_retried_then_dead_lettered_one_at_a_time() {
    a_panicking_handler_fails_its_event_only(Mode::Single, "panics_single").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_handler_holds_its_subject_then_is_dead_lettered_ordered() {
    a_panicking_handler_fails_its_event_only(Mode::Ordered, "panics_ordered").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_handler_fails_only_its_delivery_in_a_batch() {
    a_panicking_handler_fails_its_event_only(Mode::Batched, "panics_batched").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_handler_fails_only_its_delivery_in_an_ordered_batch() {
    a_panicking_handler_fails_its_event_only(Mode::OrderedBatched, "panics_ordered_batched").await;
}
