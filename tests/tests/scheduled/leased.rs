//! Rows a relay took and never marked (killed mid-batch) keep their lease
//! (`locked_until`) until it runs out, at the head of their shards' due
//! lane. Meanwhile the rows due after them in the same shards must still be
//! published at their time: the due lane must not sleep until the lease
//! ends (nor for its longest sleep) because a leased row comes first.

use std::time::Duration;

use outbox_testkit::{NatsServer, Program, TestDb, wait_until};

use super::support::{self, blocking, count_where};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_leased_to_a_dead_relay_hide_no_later_row_of_their_shards_from_the_due_lane() {
    let db = TestDb::new().await.unwrap();
    let broker = blocking(NatsServer::start).unwrap();
    let log_dir = std::env::temp_dir()
        .join("outbox-scheduled")
        .join(db.name());
    std::fs::create_dir_all(&log_dir).unwrap();
    let mut relay = Program::new("relay", support::bin_dir().join("outbox-relay"), &log_dir)
        .env("DATABASE_URL", db.url())
        .env("NATS_URL", broker.url())
        .args(["--stream", "LEASED", "--subjects", "sched.>"]);
    relay.start().await.unwrap();
    wait_until(
        "the relay holding every shard",
        Duration::from_secs(60),
        || async {
            support::count(
                &db.pool,
                "select count(*) from pg_locks where locktype = 'advisory' and granted
                   and classid::text::bigint = 1868722690
                   and database = (select oid from pg_database where datname = current_database())",
            )
            .await
                == 64
        },
    )
    .await
    .unwrap();

    // Fallen due and leased for a minute, in every shard, as due_claim.sql
    // leaves the rows of a relay killed before it marked them.
    sqlx::raw_sql(
        "begin;
         insert into outbox_events (id, event_type, source, subject, time, data, due_at)
         select gen_random_uuid(), 'sched.held', 'leased-test', 'held-' || g, now(), '{}',
                now() + interval '100 milliseconds'
           from generate_series(1, 2000) g;
         update outbox_events
            set released_at = now(), locked_until = now() + interval '60 seconds';
         commit;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        support::count(&db.pool, "select count(distinct shard) from outbox_events").await,
        64
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Rows due every 500 ms for 5 s, scheduled in one transaction.
    sqlx::raw_sql(
        "insert into outbox_events (id, event_type, source, subject, time, data, due_at)
         select gen_random_uuid(), 'sched.later', 'leased-test', 'later-' || g, now(), '{}',
                now() + g * interval '500 milliseconds'
           from generate_series(1, 10) g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    wait_until(
        "the later rows published",
        Duration::from_secs(30),
        || async {
            count_where(&db.pool, "subject like 'later-%' and published_at is null").await == 0
        },
    )
    .await
    .unwrap();
    let late: Vec<(String, f64)> = sqlx::query_as(
        "select subject, extract(epoch from published_at - due_at)::float8
           from outbox_events where subject like 'later-%' order by due_at",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    relay.terminate().await;
    let _ = std::fs::remove_dir_all(&log_dir);
    assert!(
        late.iter().all(|(_, secs)| *secs < 1.0),
        "rows behind leased ones published late (s): {late:?}"
    );
}
