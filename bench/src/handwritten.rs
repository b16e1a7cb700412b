//! A consumer written by hand against async-nats and sqlx, running billing's
//! exact SQL without the `inbox-consumer` crate: what billing's work costs
//! when nothing but that work is done, the reference the library is held to.
//!
//! A durable pull consumer with billing's filter subjects (explicit acks,
//! `ack_wait` 30 s, `max_ack_pending` as billing sets it). [`WORKERS`] tasks,
//! as many as billing's `--concurrency`, each fetch up to [`BATCH`] messages
//! (what is there, never waiting to fill the batch) and handle them in one
//! transaction: `BEGIN`; the inbox rows in one statement
//! (`inbox-consumer/queries/insert_inbox_batch.sql`); the new deliveries'
//! invoices in one statement, each under its subscription's advisory lock
//! (`examples/billing/queries/insert_invoices.sql`), and their
//! `invoice.created` events through [`Outbox::enqueue_all`] (validated
//! against the same schema, one statement); the aborted-transaction check
//! (`inbox-consumer/queries/check_tx.sql`); `COMMIT`; then each message acked
//! with `double_ack`. With `relay`, an in-process relay publishes the
//! `invoice.created` rows, configured as billing configures its own.
//!
//! Its pool is built as billing's: no test round trip before a connection
//! used within the last second is handed out ([`pool_options`]).
//!
//! What it leaves out, against billing: the leader lease and its fence check
//! in every transaction (billing is ordered by default), the `SET LOCAL`
//! timeouts (sent with `BEGIN`, in the same round trip), per-subscription
//! order across concurrent batches (each event of the backlog has a
//! subscription of its own), failure isolation and retries, tracing and
//! metrics.

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::Config;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::stream::Stream;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use futures::future::join_all;
use outbox_pg::{Envelope, Outbox};
use outbox_publisher::{Relay, RelayConfig, StreamSpec};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::harness::{BoxError, Result};

/// Transactions at once, as billing's `--concurrency`.
pub(crate) const WORKERS: usize = 16;
/// Most deliveries per transaction, as billing's `--batch`.
pub(crate) const BATCH: usize = 64;
/// The durable consumer's name, also the inbox namespace.
const CONSUMER: &str = "handwritten";

const INSERT_INBOX_BATCH: &str =
    include_str!("../../inbox-consumer/queries/insert_inbox_batch.sql");
const CHECK_TX: &str = include_str!("../../inbox-consumer/queries/check_tx.sql");
const INSERT_INVOICES: &str = include_str!("../../examples/billing/queries/insert_invoices.sql");
/// Billing's table, created as billing creates it at start.
pub(crate) const CREATE_INVOICES: &str =
    include_str!("../../examples/billing/queries/create_invoices.sql");

/// Pool options as billing's: a connection used within the last second is
/// handed out without sqlx's test round trip first (tested when it came
/// back), one idle longer is tested.
pub(crate) fn pool_options() -> sqlx::postgres::PgPoolOptions {
    use sqlx::Connection;
    sqlx::postgres::PgPoolOptions::new()
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                Ok(meta.idle_for < Duration::from_secs(1) || conn.ping().await.is_ok())
            })
        })
}

/// Consumes `stream` into `pool` until `stop` is cancelled; with `relay`,
/// publishes the `invoice.created` rows it writes as billing's relay would.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    js_stream: Stream,
    nats: async_nats::Client,
    stream: String,
    subjects: &'static [&'static str],
    filters: &'static [&'static str],
    pool: PgPool,
    outbox: Outbox,
    relay: bool,
    stop: CancellationToken,
) -> Result<()> {
    // As billing: room for two batches per slot, twice that unacked.
    let buffered = (WORKERS * BATCH * 2).max(256);
    let consumer = js_stream
        .create_consumer(Config {
            durable_name: Some(CONSUMER.into()),
            filter_subjects: filters.iter().map(|s| (*s).to_owned()).collect(),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: i64::try_from(buffered * 2).unwrap_or(i64::MAX),
            ..Default::default()
        })
        .await?;
    let relay = relay.then(|| {
        let spec = StreamSpec::new(stream, subjects.iter().map(|s| (*s).to_owned()).collect());
        // Billing's relay: rows of a crashed replica taken over after 10 s.
        let config = RelayConfig::default()
            .lease(Duration::from_secs(10))
            .publish_timeout(Duration::from_secs(2));
        tokio::spawn(Relay::run_jetstream(
            pool.clone(),
            nats,
            spec,
            config,
            stop.clone().cancelled_owned(),
        ))
    });
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (consumer, pool, outbox, stop) =
                (consumer.clone(), pool.clone(), outbox.clone(), stop.clone());
            tokio::spawn(async move { worker(consumer, pool, outbox, stop).await })
        })
        .collect();
    for worker in workers {
        worker.await??;
    }
    if let Some(relay) = relay {
        relay.await??;
    }
    Ok(())
}

async fn worker(
    consumer: PullConsumer,
    pool: PgPool,
    outbox: Outbox,
    stop: CancellationToken,
) -> Result<()> {
    while !stop.is_cancelled() {
        let mut fetched = consumer.fetch().max_messages(BATCH).messages().await?;
        let mut messages = Vec::with_capacity(BATCH);
        while let Some(message) = fetched.next().await {
            messages.push(message?);
        }
        if messages.is_empty() {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(5)) => {}
                () = stop.cancelled() => {}
            }
            continue;
        }
        handle(&pool, &outbox, &messages).await?;
        // Committed: only now acked, each confirmed by the server.
        for acked in join_all(messages.iter().map(|m| m.double_ack())).await {
            acked?;
        }
    }
    Ok(())
}

/// One transaction for the batch, with billing's statements.
async fn handle(
    pool: &PgPool,
    outbox: &Outbox,
    messages: &[async_nats::jetstream::Message],
) -> Result<()> {
    let events: Vec<Envelope<Value>> = messages
        .iter()
        .map(|m| Envelope::from_json(&m.payload))
        .collect::<std::result::Result<_, _>>()?;
    let ids: Vec<Uuid> = events.iter().map(|e| *e.id().as_uuid()).collect();
    let types: Vec<&str> = events.iter().map(|e| e.event_type().as_str()).collect();
    let subjects: Vec<&str> = events.iter().map(Envelope::subject).collect();
    let times: Vec<DateTime<Utc>> = events.iter().map(Envelope::time).collect();
    let sequences: Vec<Option<i64>> = events
        .iter()
        .map(|e| e.sequence().and_then(|s| i64::try_from(s).ok()))
        .collect();
    let mut tx = pool.begin().await?;
    let fresh: HashSet<Uuid> = sqlx::query_scalar(INSERT_INBOX_BATCH)
        .bind(CONSUMER)
        .bind(&ids)
        .bind(&types)
        .bind(&subjects)
        .bind(&times)
        .bind(&sequences)
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .collect();
    let mut columns = Invoices::default();
    let mut invoices = Vec::with_capacity(fresh.len());
    for event in events.iter().filter(|e| fresh.contains(e.id().as_uuid())) {
        let data = event.data();
        let field = |name: &str| -> Result<&str> {
            data[name]
                .as_str()
                .ok_or_else(|| BoxError::from(format!("{name} missing")))
        };
        let (subscription, customer) = (field("subscription_id")?, field("customer_id")?);
        let amount = data["amount_cents"].as_i64().unwrap_or_default();
        let invoice_id = Uuid::now_v7();
        invoices.push(Envelope::new(
            "invoice.created",
            "billing",
            subscription,
            json!({
                "invoice_id": invoice_id.to_string(),
                "subscription_id": subscription,
                "customer_id": customer,
                "amount_cents": amount,
            }),
        )?);
        columns.ids.push(invoice_id);
        columns.subscriptions.push(subscription.to_owned());
        columns.customers.push(customer.to_owned());
        columns.amounts.push(amount);
        columns.events.push(*event.id().as_uuid());
    }
    if !invoices.is_empty() {
        sqlx::query(INSERT_INVOICES)
            .bind(&columns.ids)
            .bind(&columns.subscriptions)
            .bind(&columns.customers)
            .bind(&columns.amounts)
            .bind(&columns.events)
            .execute(&mut *tx)
            .await?;
        outbox.enqueue_all(&mut tx, &invoices).await?;
    }
    sqlx::query(CHECK_TX).fetch_one(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// The columns of a batch's invoices, for the one insert.
#[derive(Default)]
struct Invoices {
    ids: Vec<Uuid>,
    subscriptions: Vec<String>,
    customers: Vec<String>,
    amounts: Vec<i64>,
    events: Vec<Uuid>,
}
