//! The harness itself: real servers start, and the fault operations the other
//! suites rely on (broker stop / kill -9 / restart, Postgres restart) work.

use std::time::Duration;

use outbox_testkit::{NatsServer, PgServer, TestDb, wait_until};

#[tokio::test]
async fn nats_survives_kill_and_restart_with_its_stream() {
    let mut server = NatsServer::start().unwrap();
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(server.url())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client.clone());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "HARNESS".into(),
        subjects: vec!["harness.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    js.publish("harness.a", "one".into())
        .await
        .unwrap()
        .await
        .unwrap();

    server.kill().unwrap();
    assert!(!server.is_running());
    let publish = js.publish("harness.a", "lost".into()).await;
    let acked = match publish {
        Ok(ack) => tokio::time::timeout(Duration::from_secs(2), ack)
            .await
            .is_ok_and(|r| r.is_ok()),
        Err(_) => false,
    };
    assert!(!acked, "a killed broker must not ack");

    server.start_again().unwrap();
    wait_until("client reconnect", Duration::from_secs(10), || {
        let client = client.clone();
        async move { client.connection_state() == async_nats::connection::State::Connected }
    })
    .await
    .unwrap();
    js.publish("harness.a", "two".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let mut stream = js.get_stream("HARNESS").await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        2,
        "file store kept message one"
    );

    server.restart().unwrap();
    assert!(server.is_running());
}

#[tokio::test]
async fn postgres_restart_keeps_committed_data() {
    let mut server = tokio::task::spawn_blocking(PgServer::start)
        .await
        .unwrap()
        .unwrap();
    let db = TestDb::on(&server).await.unwrap();
    sqlx::query("create table t (x int)")
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("insert into t values (1)")
        .execute(&db.pool)
        .await
        .unwrap();

    server = tokio::task::spawn_blocking(move || server.restart().map(|()| server))
        .await
        .unwrap()
        .unwrap();

    // The pool's old connections are dead; a fresh one sees the committed row.
    wait_until("postgres back", Duration::from_secs(30), || {
        let pool = db.pool.clone();
        async move { sqlx::query("select 1").execute(&pool).await.is_ok() }
    })
    .await
    .unwrap();
    let seen: i64 = sqlx::query_scalar("select count(*) from t")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(seen, 1);
    drop(server);
}
