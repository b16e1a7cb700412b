//! Billing's stack driven by hand against a real Postgres, without a broker:
//! deliveries are built as the runtime builds them and sent through
//! [`example_billing::service`], so every redelivery and reordering can be
//! staged exactly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

use std::time::Duration;

use example_billing::{NotInvoicedYet, StackOptions, default_schemas_dir, migrate, service};
use inbox_consumer::{Action, BoxError, Delivery, DeliveryInfo, HandlerError, InTx, Outcome};
use outbox_pg::{Envelope, Outbox, SchemaRegistry};
use outbox_testkit::TestDb;
use serde_json::{Value, json};
use sqlx::PgPool;
use tower::ServiceExt;

async fn db() -> (TestDb, Outbox) {
    let db = TestDb::new().await.unwrap();
    migrate(&db.pool).await.unwrap();
    migrate(&db.pool).await.unwrap(); // start-up is idempotent
    let outbox = Outbox::new(SchemaRegistry::from_dir(default_schemas_dir()).unwrap());
    (db, outbox)
}

fn created(subscription: &str, customer: &str, amount: i64) -> Envelope<Value> {
    Envelope::new(
        "subscription.created",
        "subscriptions",
        customer,
        json!({"subscription_id": subscription, "customer_id": customer, "plan": "pro", "amount_cents": amount}),
    )
    .unwrap()
}

fn cancelled(subscription: &str, customer: &str) -> Envelope<Value> {
    Envelope::new(
        "subscription.cancelled",
        "subscriptions",
        customer,
        json!({"subscription_id": subscription, "customer_id": customer}),
    )
    .unwrap()
}

async fn deliver(
    pool: &PgPool,
    outbox: &Outbox,
    options: StackOptions,
    event: &Envelope<Value>,
) -> Result<Outcome, BoxError> {
    let delivery = Delivery::new(event.clone(), DeliveryInfo::new("billing"));
    service(pool.clone(), outbox.clone(), options)
        .oneshot(delivery)
        .await
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_redelivered_creation_raises_one_invoice_and_one_event() {
    let (db, outbox) = db().await;
    let event = created("sub_1", "cus_1", 1234);
    let first = deliver(&db.pool, &outbox, StackOptions::default(), &event).await;
    assert_eq!(first.unwrap(), Outcome::Handled);
    let again = deliver(&db.pool, &outbox, StackOptions::default(), &event).await;
    assert_eq!(again.unwrap(), Outcome::Duplicate);

    let (subscription, customer, amount, event_id): (String, String, i64, uuid::Uuid) =
        sqlx::query_as("select subscription_id, customer_id, amount_cents, event_id from invoices")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (subscription.as_str(), customer.as_str(), amount),
        ("sub_1", "cus_1", 1234)
    );
    assert_eq!(event_id, *event.id().as_uuid());
    let (event_type, source, subject, data): (String, String, String, Value) =
        sqlx::query_as("select event_type, source, subject, data from outbox_events")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (event_type.as_str(), source.as_str(), subject.as_str()),
        ("invoice.created", "billing", "sub_1")
    );
    assert_eq!(data["subscription_id"], "sub_1");
    assert_eq!(data["amount_cents"], 1234);
}

#[tokio::test]
async fn without_the_inbox_a_redelivery_bills_twice() {
    // What `billing --no-dedupe` does, and what the chaos checker must catch.
    let (db, outbox) = db().await;
    let event = created("sub_1", "cus_1", 500);
    let no_dedupe = || StackOptions::default().dedupe(false);
    for _ in 0..2 {
        let out = deliver(&db.pool, &outbox, no_dedupe(), &event).await;
        assert_eq!(out.unwrap(), Outcome::Handled);
    }
    assert_eq!(count(&db.pool, "select count(*) from invoices").await, 2);
    assert_eq!(
        count(&db.pool, "select count(*) from inbox_events").await,
        0
    );
}

#[tokio::test]
async fn a_cancellation_before_its_creation_is_retried_then_voids_the_invoice() {
    let (db, outbox) = db().await;
    let create = created("sub_1", "cus_1", 700);
    let cancel = cancelled("sub_1", "cus_1");

    let early = deliver(&db.pool, &outbox, StackOptions::default(), &cancel)
        .await
        .unwrap_err();
    let early = early.downcast_ref::<HandlerError>().unwrap();
    assert_eq!(
        early.action(),
        Action::Retry {
            after: Some(Duration::from_secs(1))
        }
    );
    assert!(early.get_ref().downcast_ref::<NotInvoicedYet>().is_some());
    assert_eq!(
        count(&db.pool, "select count(*) from inbox_events").await,
        0,
        "the failed attempt's inbox row rolled back"
    );

    let out = deliver(&db.pool, &outbox, StackOptions::default(), &create).await;
    assert_eq!(out.unwrap(), Outcome::Handled);
    let out = deliver(&db.pool, &outbox, StackOptions::default(), &cancel).await;
    assert_eq!(out.unwrap(), Outcome::Handled);
    assert_eq!(
        count(
            &db.pool,
            "select count(*) from invoices where voided_at is not null"
        )
        .await,
        1
    );

    // A second cancellation event (another id) of a voided invoice does nothing.
    let voided_at = "select voided_at::text from invoices";
    let before: String = sqlx::query_scalar(voided_at)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let out = deliver(
        &db.pool,
        &outbox,
        StackOptions::default(),
        &cancelled("sub_1", "cus_1"),
    )
    .await;
    assert_eq!(out.unwrap(), Outcome::Handled);
    let after: String = sqlx::query_scalar(voided_at)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(before, after);
}

#[tokio::test]
async fn a_payload_the_invoice_schema_refuses_is_rejected_with_nothing_written() {
    let (db, outbox) = db().await;
    // A negative amount passes billing's decoding but not invoice.created's schema.
    let event = created("sub_1", "cus_1", -5);
    let err = deliver(&db.pool, &outbox, StackOptions::default(), &event)
        .await
        .unwrap_err();
    let err = err.downcast_ref::<HandlerError>().unwrap();
    assert_eq!(err.action(), Action::Reject, "{err}");
    assert_eq!(count(&db.pool, "select count(*) from invoices").await, 0);
    assert_eq!(
        count(&db.pool, "select count(*) from inbox_events").await,
        0
    );
    assert_eq!(
        count(&db.pool, "select count(*) from outbox_events").await,
        0
    );
}

/// A `subscription.trial_ended` as the relay publishes it: scheduled for the
/// trial's end (`scheduledfor`), with no `sequence`.
fn trial_ended(subscription: &str, customer: &str) -> Envelope<Value> {
    let ended = chrono::DateTime::parse_from_rfc3339("2026-03-01T12:00:00.123456Z")
        .unwrap()
        .to_utc();
    Envelope::new(
        "subscription.trial_ended",
        "subscriptions",
        subscription,
        json!({"subscription_id": subscription, "customer_id": customer, "trial_ended_at": ended}),
    )
    .unwrap()
    .with_time(ended)
    .with_scheduled_for(ended)
}

#[tokio::test]
async fn a_redelivered_trial_end_is_recorded_once_and_twice_without_the_inbox() {
    let (db, outbox) = db().await;
    let event = trial_ended("sub_1", "cus_1");
    let first = deliver(&db.pool, &outbox, StackOptions::default(), &event).await;
    assert_eq!(first.unwrap(), Outcome::Handled);
    let again = deliver(&db.pool, &outbox, StackOptions::default(), &event).await;
    assert_eq!(again.unwrap(), Outcome::Duplicate);
    let (subscription, customer, ended, event_id): (
        String,
        String,
        chrono::DateTime<chrono::Utc>,
        uuid::Uuid,
    ) = sqlx::query_as(
        "select subscription_id, customer_id, trial_ended_at, event_id from trial_ends",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (subscription.as_str(), customer.as_str()),
        ("sub_1", "cus_1")
    );
    assert_eq!(Some(ended), event.scheduled_for());
    assert_eq!(event_id, *event.id().as_uuid());
    assert_eq!(
        count(
            &db.pool,
            "select count(*) from inbox_events where event_type = 'subscription.trial_ended'"
        )
        .await,
        1
    );

    // Only the inbox keeps the second delivery from recording a second end.
    let other = trial_ended("sub_2", "cus_2");
    for _ in 0..2 {
        let out = deliver(
            &db.pool,
            &outbox,
            StackOptions::default().dedupe(false),
            &other,
        )
        .await;
        assert_eq!(out.unwrap(), Outcome::Handled);
    }
    assert_eq!(
        count(
            &db.pool,
            "select count(*) from trial_ends where subscription_id = 'sub_2'"
        )
        .await,
        2
    );
}

/// The inner stack of one replica, holding its transaction open (handler done,
/// not yet committed) until released: a creation caught between its insert and
/// its commit.
#[derive(Clone)]
struct HoldBeforeCommit {
    inner: example_billing::Handlers,
    holding: std::sync::Arc<tokio::sync::Notify>,
    release: std::sync::Arc<tokio::sync::Notify>,
}

impl tower::Service<InTx<Delivery>> for HoldBeforeCommit {
    type Response = InTx<Outcome>;
    type Error = BoxError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<InTx<Outcome>, BoxError>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), BoxError>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: InTx<Delivery>) -> Self::Future {
        let inner = self.inner.clone();
        let (holding, release) = (self.holding.clone(), self.release.clone());
        Box::pin(async move {
            let out = inner.oneshot(request).await?;
            holding.notify_one();
            release.notified().await;
            Ok(out)
        })
    }
}

/// Waits (bounded) until a backend of this database waits on an advisory lock.
async fn until_a_backend_waits_on_a_lock(pool: &PgPool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "select count(*) from pg_stat_activity
              where datname = current_database()
                and wait_event_type = 'Lock' and wait_event = 'advisory'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cancellation never waited for the creation in flight"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_cancellation_racing_its_creation_on_another_replica_voids_the_invoice_every_time() {
    // The interleaving that once left invoices valid: replica A has inserted the
    // invoice but not committed; replica B handles the cancellation; A commits
    // while B is in the middle of its transaction (inbox row inserted, decision
    // not yet made). B must void the invoice, not retry it away or ack it.
    let (db, outbox) = db().await;
    let replica_a = PgPool::connect(db.url()).await.unwrap();
    let replica_b = PgPool::connect(db.url()).await.unwrap();
    let holding = std::sync::Arc::new(tokio::sync::Notify::new());
    let release = std::sync::Arc::new(tokio::sync::Notify::new());
    let creator = inbox_consumer::Dedupe::new(
        HoldBeforeCommit {
            inner: example_billing::handlers(outbox.clone()),
            holding: holding.clone(),
            release: release.clone(),
        },
        replica_a.clone(),
    );

    let rounds = 20;
    for round in 0..rounds {
        let subscription = format!("sub_race_{round}");
        let create = Delivery::new(
            created(&subscription, "cus_1", 900),
            DeliveryInfo::new("billing"),
        );
        let cancel = Delivery::new(
            cancelled(&subscription, "cus_1"),
            DeliveryInfo::new("billing"),
        );

        let creation = tokio::spawn(creator.clone().oneshot(create));
        holding.notified().await; // A: invoice inserted, transaction open
        let cancellation = tokio::spawn(
            service(replica_b.clone(), outbox.clone(), StackOptions::default()).oneshot(cancel),
        );
        until_a_backend_waits_on_a_lock(&db.pool).await; // B: mid-transaction, waiting
        release.notify_one(); // A commits now, between B's steps
        assert_eq!(creation.await.unwrap().unwrap(), Outcome::Handled);
        assert_eq!(
            cancellation.await.unwrap().unwrap(),
            Outcome::Handled,
            "round {round}: the cancellation must apply once the creation committed"
        );
        let voided: bool = sqlx::query_scalar(
            "select bool_and(voided_at is not null) from invoices where subscription_id = $1",
        )
        .bind(&subscription)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert!(voided, "round {round}: the invoice stayed valid");
    }
    assert_eq!(
        count(
            &db.pool,
            "select count(*) from invoices where voided_at is null"
        )
        .await,
        0
    );
    assert_eq!(
        count(&db.pool, "select count(*) from inbox_events").await,
        2 * rounds
    );
}
