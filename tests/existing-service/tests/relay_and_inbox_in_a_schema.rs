//! The relay and the inbox's dedupe, in a schema of their own reached through
//! the `search_path`: the service places an order, the library relay
//! publishes its event to JetStream from `tenant.outbox_events`, and a
//! consumer's `Dedupe` records it once in `tenant.inbox_events` with its
//! effect, a redelivery being a duplicate.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

#[allow(dead_code)] // the checks of the other test file
mod support;

use existing_service::Order;
use inbox_consumer::{
    Dedupe, Delivery, DeliveryInfo, Handler, HandlerError, HandlerService, Outcome,
};
use outbox_pg::Envelope;
use outbox_publisher::{Relay, RelayConfig, StreamSpec};
use serde_json::Value;
use sqlx::PgTransaction;
use support::{Target, assert_placed, fresh, run_ok, server};
use tower::ServiceExt;

/// Records each order it is handed in `shipments`, in the inbox's transaction.
#[derive(Clone)]
struct Ship;

impl Handler for Ship {
    type Message = Value;

    async fn handle(
        &self,
        event: Envelope<Value>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        sqlx::query("insert into shipments (order_id) values ($1)")
            .bind(event.id().to_string())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

#[tokio::test]
async fn the_relay_and_the_inbox_work_in_a_schema_of_their_own() {
    let server = server().await;
    let db = fresh(&server, Target::Tenant).await;
    run_ok(&db, Order::AppFirst).await;
    // The consumer's own table, beside the inbox, at its start-up.
    outbox_pg::migrate_with(
        &db.pool,
        "create table if not exists shipments (order_id text primary key)",
    )
    .await
    .unwrap();
    assert_placed(&db).await;

    let broker = tokio::task::spawn_blocking(outbox_testkit::nats)
        .await
        .unwrap()
        .unwrap();
    let client = async_nats::connect(broker.url()).await.unwrap();
    let stream = StreamSpec::new("EXISTING_SERVICE", vec!["order.>".into()]);
    let relay = Relay::jetstream(
        db.pool.clone(),
        client.clone(),
        &stream,
        RelayConfig::default(),
    )
    .await
    .unwrap();
    let report = relay.drain().await.unwrap();
    assert_eq!((report.published, report.failed), (1, 0), "{report:?}");
    let unpublished: i64 =
        sqlx::query_scalar("select count(*) from tenant.outbox_events where published_at is null")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(unpublished, 0);

    let js = async_nats::jetstream::new(client);
    let message = js
        .get_stream("EXISTING_SERVICE")
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap();
    let event = Envelope::<Value>::from_json(&message.payload).unwrap();
    assert_eq!(event.event_type().as_str(), "order.placed");
    assert_eq!(event.sequence(), Some(1), "the seq trigger's number");

    let stack = Dedupe::new(HandlerService::new(Ship), db.pool.clone());
    let deliver = || {
        stack
            .clone()
            .oneshot(Delivery::new(event.clone(), DeliveryInfo::new("shipping")))
    };
    assert_eq!(deliver().await.unwrap(), Outcome::Handled);
    assert_eq!(deliver().await.unwrap(), Outcome::Duplicate);
    let (inbox, shipments): (i64, i64) = sqlx::query_as(
        "select (select count(*) from tenant.inbox_events where consumer = 'shipping'),
                (select count(*) from tenant.shipments)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((inbox, shipments), (1, 1));
    assert_placed(&db).await;
}
