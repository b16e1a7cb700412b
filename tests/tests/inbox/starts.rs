//! Where a durable starts when the runtime has to create it, against real
//! PostgreSQL and nats-server: no event past the inbox window is applied
//! again.
//!
//! - the durable deleted by an operator, the inbox rows gone past retention:
//!   the durable created again resumes after the recorded ack floor, and no
//!   effect is applied twice;
//! - a deployment under a new durable name (same stream, same subjects)
//!   starts where the old name stopped; a replay happens only when asked
//!   (`Start::All`);
//! - a recorded position past the end of the stream (the stream created
//!   anew) is refused at start, naming why.

use inbox_consumer::{Consumer, ErrorKind, Start};
use outbox_pg::Envelope;
use outbox_testkit::wait_until;
use serde_json::Value;
use serde_json::json;

use super::world::*;

async fn ack_floor(world: &World, consumer: &str) -> i64 {
    sqlx::query_scalar("select ack_floor from inbox_consumers where consumer = $1")
        .bind(consumer)
        .fetch_one(&world.db.pool)
        .await
        .unwrap()
}

/// Every event of `events` applied exactly `times` times in `effects`.
async fn each_applied(world: &World, events: usize, times: i64) {
    let rows: Vec<(i64,)> =
        sqlx::query_as("select count(*) from effects group by event_id order by 1")
            .fetch_all(&world.db.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), events, "events with an effect");
    assert!(
        rows.iter().all(|(n,)| *n == times),
        "each event applied {times} time(s): {rows:?}"
    );
}

/// Handles `seq` (one new event) with `durable` and waits until it is applied
/// and every message of the durable settled: what the durable delivers before
/// it (stream order) is applied by then.
async fn handle_one_more(
    world: &World,
    durable: &str,
    seq: i64,
    config: inbox_consumer::ConsumerConfig,
) {
    let running = start(world, config, stack(&world.db.pool, Record::new("r"))).await;
    let before = world.count("select count(*) from effects").await;
    world
        .publish(&event("t.ok", "s-new", json!({ "seq": seq })))
        .await;
    wait_until_effect_of(world, seq).await;
    world.wait_settled(durable).await;
    running.shutdown().await;
    assert!(world.count("select count(*) from effects").await > before);
}

async fn wait_until_effect_of(world: &World, seq: i64) {
    world
        .wait_count(
            "the new event applied",
            &format!("select count(*) from effects where seq = {seq}"),
            1,
        )
        .await;
}

/// Publishes `events`, starts `durable` on them and waits until each is
/// applied and every message of the durable settled.
async fn start_on(world: &World, durable: &str, events: &[Envelope<Value>]) -> Running {
    world.publish_all(events).await;
    let running = start(
        world,
        config(world, durable),
        stack(&world.db.pool, Record::new("a")),
    )
    .await;
    world
        .wait_count(
            "every published event applied",
            "select count(*) from effects",
            i64::try_from(events.len()).unwrap(),
        )
        .await;
    world.wait_settled(durable).await;
    running
}

async fn delete_durable(world: &World, durable: &str) {
    let stream = world.js.get_stream(&world.stream).await.unwrap();
    stream.delete_consumer(durable).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_created_again_resumes_after_the_recorded_floor_and_applies_nothing_twice() {
    let world = world("STARTS_AGAIN").await;
    let events: Vec<_> = (0..50)
        .map(|i| event("t.ok", &format!("s{}", i % 5), json!({ "seq": i })))
        .collect();
    let running = start_on(&world, "billing", &events).await;
    // While running, the recorded floor follows the acks closely (a process
    // killed now would leave it there).
    wait_until(
        "the ack floor recorded while running",
        std::time::Duration::from_secs(3),
        || async { ack_floor(&world, "billing").await == 50 },
    )
    .await
    .unwrap();
    running.shutdown().await;
    assert_eq!(
        ack_floor(&world, "billing").await,
        50,
        "the floor recorded at stop"
    );

    // The inbox rows are gone, as retention deletes them past the window, and
    // an operator deletes the durable.
    sqlx::query("delete from inbox_events")
        .execute(&world.db.pool)
        .await
        .unwrap();
    delete_durable(&world, "billing").await;

    handle_one_more(&world, "billing", 50, config(&world, "billing")).await;
    each_applied(&world, 51, 1).await;
    assert_eq!(ack_floor(&world, "billing").await, 51);

    // A new deployment renames the consumer: it starts where `billing` stopped.
    handle_one_more(&world, "billing-v2", 51, config(&world, "billing-v2")).await;
    each_applied(&world, 52, 1).await;
    let renamed: i64 = world
        .count("select count(*) from inbox_events where consumer = 'billing-v2'")
        .await;
    assert_eq!(
        renamed, 1,
        "the renamed consumer handled only the new event"
    );

    // Asked for, a replay applies the stream again.
    handle_one_more(
        &world,
        "billing-replay",
        52,
        config(&world, "billing-replay").start(Start::All),
    )
    .await;
    world
        .wait_count(
            "the replay applied every event again",
            "select count(*) from inbox_events where consumer = 'billing-replay'",
            53,
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_floor_past_the_end_of_a_stream_created_anew_is_refused() {
    let world = world("STARTS_ANEW").await;
    let events: Vec<_> = (0..3)
        .map(|i| event("t.ok", "s", json!({ "seq": i })))
        .collect();
    let running = start_on(&world, "billing", &events).await;
    running.shutdown().await;
    assert_eq!(ack_floor(&world, "billing").await, 3);

    world.js.delete_stream(&world.stream).await.unwrap();
    world
        .js
        .create_stream(async_nats::jetstream::stream::Config {
            name: world.stream.clone(),
            subjects: vec!["t.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let refused = Consumer::new(
        world.db.pool.clone(),
        world.js.clone(),
        config(&world, "billing"),
    )
    .await
    .expect_err("a floor past the stream's end is refused");
    assert_eq!(refused.kind(), ErrorKind::Config);
    let text = refused.to_string();
    assert!(
        text.contains("created anew") && text.contains("billing") && text.contains("Start::All"),
        "names why and what to choose: {text}"
    );

    // Choosing where to start is accepted.
    handle_one_more(
        &world,
        "billing",
        3,
        config(&world, "billing").start(Start::New),
    )
    .await;
    each_applied(&world, 4, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_name_beside_a_running_consumer_is_another_consumer_not_a_rename() {
    let world = world("STARTS_BESIDE").await;
    let events: Vec<_> = (0..5)
        .map(|i| event("t.ok", &format!("s{i}"), json!({ "seq": i })))
        .collect();
    let a = start_on(&world, "a", &events).await;
    wait_until(
        "a's floor recorded",
        std::time::Duration::from_secs(3),
        || async { ack_floor(&world, "a").await == 5 },
    )
    .await
    .unwrap();
    // `a` still runs: `b` reads the stream for itself.
    let b = start(
        &world,
        config(&world, "b"),
        stack(&world.db.pool, Record::new("b")),
    )
    .await;
    world
        .wait_count(
            "b handled every event",
            "select count(*) from inbox_events where consumer = 'b'",
            5,
        )
        .await;
    b.shutdown().await;
    a.shutdown().await;
}
