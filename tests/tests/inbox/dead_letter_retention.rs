//! Dead-letter retention against real PostgreSQL and nats-server:
//! `inbox_dead_letters` is bounded like the inbox, on its own, longer window
//! (30 days by default).
//!
//! - The runtime prunes its consumer's dead letters past the window on the
//!   retention interval, and only those: recent ones (a poison message just
//!   dead-lettered by the runtime among them) and other consumers' stay.
//! - `retention::prune_dead_letters` (for a tool: one consumer or all)
//!   deletes in batches until none is left past the cutoff.
//! - A window of `None` keeps every dead letter.

use std::time::Duration;

use inbox_consumer::Retention;
use inbox_consumer::retention::{DEFAULT_DEAD_LETTER_WINDOW, prune_dead_letters};
use outbox_testkit::wait_until;
use sqlx::PgPool;

use super::world::*;

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// Writes `n` dead letters of `consumer` recorded `age_days` ago.
async fn dead_letters(pool: &PgPool, consumer: &str, n: i64, age_days: i32) {
    sqlx::query(
        "insert into inbox_dead_letters
           (consumer, stream, stream_sequence, subject, delivery_count, reason, error, payload, created_at)
         select $1, 'OLD', g, 't.bad', 1, 'not_json', 'written by the test', 'x'::bytea,
                now() - make_interval(days => $3)
           from generate_series(1, $2) g",
    )
    .bind(consumer)
    .bind(n)
    .bind(age_days)
    .execute(pool)
    .await
    .unwrap();
}

async fn count(pool: &PgPool, consumer: &str, older_than_days: i32) -> i64 {
    sqlx::query_scalar(
        "select count(*) from inbox_dead_letters
          where consumer = $1 and created_at < now() - make_interval(days => $2)",
    )
    .bind(consumer)
    .bind(older_than_days)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_runtime_prunes_its_dead_letters_past_the_window_and_keeps_the_rest() {
    let w = world("DL_RETENTION").await;
    let pool = &w.db.pool;
    dead_letters(pool, "dl_a", 3, 40).await;
    dead_letters(pool, "dl_a", 2, 1).await;
    dead_letters(pool, "dl_b", 2, 40).await;

    // A poison message the runtime dead-letters now: it must outlive pruning.
    w.publish_raw("t.ok", b"not json".to_vec(), "poison-1")
        .await;
    let config = config(&w, "dl_a").retention(
        Retention::default()
            .interval(Duration::from_secs(1))
            .dead_letter_window(Some(DEFAULT_DEAD_LETTER_WINDOW)),
    );
    let running = start(&w, config, stack(pool, Record::new("a"))).await;
    w.wait_count(
        "the poison message dead-lettered",
        "select count(*) from inbox_dead_letters where consumer = 'dl_a' and stream = 'DL_RETENTION'",
        1,
    )
    .await;
    wait_until(
        "dl_a's dead letters past 30 days pruned",
        Duration::from_secs(30),
        || async { count(pool, "dl_a", 30).await == 0 },
    )
    .await
    .unwrap();
    running.shutdown().await;
    let rows: Vec<(String, String, String)> = sqlx::query_as(
        "select consumer, stream, created_at::text from inbox_dead_letters order by id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        count(pool, "dl_a", 0).await,
        3,
        "recent dead letters kept: {rows:?}"
    );
    assert_eq!(count(pool, "dl_b", 30).await, 2, "another consumer's kept");

    // The tool's call: every consumer, in batches.
    dead_letters(pool, "dl_c", 2_500, 31).await;
    let deleted = prune_dead_letters(pool, None, 30 * DAY).await.unwrap();
    assert_eq!(deleted, 2_502);
    assert_eq!(count(pool, "dl_b", 0).await, 0);
    assert_eq!(count(pool, "dl_c", 0).await, 0);
    // One consumer only, any age: the others' stay.
    dead_letters(pool, "dl_b", 1, 0).await;
    let deleted = prune_dead_letters(pool, Some("dl_a"), Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(deleted, 3);
    assert_eq!(count(pool, "dl_a", -1).await, 0);
    assert_eq!(count(pool, "dl_b", -1).await, 1);

    // No window: kept for ever.
    dead_letters(pool, "dl_b", 2, 400).await;
    let kept = Retention::default()
        .dead_letter_window(None)
        .prune_dead_letters(pool, "dl_b")
        .await
        .unwrap();
    assert_eq!(kept, 0);
    assert_eq!(count(pool, "dl_b", 300).await, 2);
}
