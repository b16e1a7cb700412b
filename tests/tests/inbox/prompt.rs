//! What a batched consumer does for an event alone, against real PostgreSQL
//! and nats-server:
//!
//! - it is handled as soon as it arrives: the runtime neither waits for a
//!   batch to fill nor for its pull to end (an unordered consumer's pull
//!   lives 2 s);
//! - a pooled connection the server ended while idle costs the event
//!   nothing: with `inbox_consumer::pool::handler_pool` (no test round trip
//!   before a recently used connection's `BEGIN`), the `BEGIN` that finds it
//!   gone is sent again on another connection, and the delivery neither
//!   fails nor waits for a retry.

use std::time::{Duration, Instant};

use inbox_consumer::pool::handler_pool;
use outbox_testkit::wait_until;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::world::*;

/// What a lone event may take from its publish to its effect. An unordered
/// consumer's pull lives 2 s; a runtime that waited for it to end, or for
/// a batch to fill, would take that long.
const PROMPT: Duration = Duration::from_millis(1_000);

#[tokio::test(flavor = "multi_thread")]
async fn a_lone_event_is_handled_at_once_not_when_a_batch_fills_or_a_pull_ends() {
    let w = world("INBOX_PROMPT").await;
    let handler = Record::new("a");
    let config = config(&w, "prompt").max_batch(64).concurrency(4);
    let running = start_batched(&w, config, batch_stack(&w.db.pool, handler.clone())).await;
    let mut took = Vec::new();
    for i in 0..6 {
        // Each alone: published once the one before has its effect.
        let event = ok(&format!("sub_prompt_{i}"), 1);
        let sent = Instant::now();
        w.publish(&event).await;
        wait_until("the event has its effect", WAIT, || async {
            effects_of(&w, &event).await == 1
        })
        .await
        .unwrap();
        took.push(sent.elapsed());
    }
    running.shutdown().await;
    // The first waits for the durable's first pull and the pool's first
    // connection; the others find both ready.
    took.remove(0);
    took.sort();
    let median = took[took.len() / 2];
    assert!(
        median < PROMPT,
        "a lone event took {median:?} (each: {took:?}): the runtime waited for more"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pooled_connection_the_server_ended_is_replaced_at_begin_without_failing_the_delivery() {
    let w = world("INBOX_ENDED_CONN").await;
    let handler = Record::new("a");
    let name = "inbox_ended_conn";
    let options: PgConnectOptions = w.db.url().parse::<PgConnectOptions>().unwrap();
    let pool = handler_pool(PgPoolOptions::new())
        .max_connections(2)
        .connect_with(options.application_name(name))
        .await
        .unwrap();
    let config = config(&w, "ended").max_batch(64).concurrency(2);
    let running = start_batched(&w, config, batch_stack(&pool, handler.clone())).await;
    let first = ok("sub_ended_1", 1);
    w.publish(&first).await;
    wait_until("the first event has its effect", WAIT, || async {
        effects_of(&w, &first).await == 1
    })
    .await
    .unwrap();
    // The server ends the pool's idle connections; the pool does not know.
    let ended: i64 = sqlx::query_scalar(
        "select count(*) from (select pg_terminate_backend(pid) from pg_stat_activity \
          where application_name = $1) t",
    )
    .bind(name)
    .fetch_one(&w.db.pool)
    .await
    .unwrap();
    assert!(ended >= 1, "no connection of the pool to end");
    // Within a second of their last use: handed out without a test.
    let second = ok("sub_ended_2", 1);
    w.publish(&second).await;
    wait_until("the second event has its effect", WAIT, || async {
        effects_of(&w, &second).await == 1
    })
    .await
    .unwrap();
    w.wait_settled("ended").await;
    running.shutdown().await;
    assert_eq!(
        counter("inbox_failed_total", "ended"),
        0,
        "the delivery failed on the ended connection"
    );
    assert_eq!(handler.attempts(&second), 1);
}
