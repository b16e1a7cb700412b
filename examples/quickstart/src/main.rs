//! The quickest real round trip: a typed event declared once; a subscription
//! row and its `subscription.created` event committed in one transaction, a
//! rolled-back one and a schema-invalid one that never leave; the relay moving
//! the committed events to JetStream; the stream read back; and a consumer
//! built with `Consumer::builder` opening one account per subscription through
//! the inbox.
//!
//! ```text
//! cargo run --bin quickstart                      # starts its own Postgres and nats-server
//! DATABASE_URL=postgres://… NATS_URL=nats://… cargo run --bin quickstart
//! ```

use std::error::Error;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use clap::Parser;
use futures::StreamExt;
use inbox_consumer::prelude::*;
use outbox_pg::connect::{DatabaseArgs, NatsArgs};
use outbox_publisher::{Relay, RelayConfig, StreamSpec};
use outbox_testkit::{nats, postgres};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, PgTransaction};
use tokio_util::sync::CancellationToken;

/// A customer subscribed to a plan: the type string, the payload and its
/// schema (derived: a negative amount is refused), declared once.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SubscriptionCreated {
    #[schemars(length(min = 1))]
    subscription_id: String,
    customer_id: String,
    plan: String,
    #[schemars(range(min = 0))]
    amount_cents: i64,
}

impl Event for SubscriptionCreated {
    const TYPE: &'static str = "subscription.created";
}

/// Opens an account per subscription, in the inbox's transaction.
#[derive(Clone)]
struct OpenAccount;

impl Handler for OpenAccount {
    type Message = SubscriptionCreated;

    async fn handle(
        &self,
        event: Envelope<SubscriptionCreated>,
        tx: &mut PgTransaction<'static>,
    ) -> Result<(), HandlerError> {
        sqlx::query("insert into accounts (subscription_id, plan) values ($1, $2)")
            .bind(&event.data().subscription_id)
            .bind(&event.data().plan)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// No flags: the servers come from the environment.
#[derive(Debug, Parser)]
#[command(
    name = "quickstart",
    version,
    about = "The quickest real round trip: a row and its event in one transaction, relayed to JetStream, consumed once",
    long_about = "The quickest real round trip: a row and its event in one transaction, relayed to \
                  JetStream, consumed once through the inbox.\n\nUses the PostgreSQL and nats-server \
                  named by DATABASE_URL and NATS_URL, or starts its own on loopback."
)]
struct Args {}

/// A fatal error is one plain line on stderr (its message and causes), and
/// exit status 1.
#[tokio::main]
async fn main() -> std::process::ExitCode {
    let Args {} = Args::parse();
    outbox_pg::exit_code("quickstart", run().await)
}

async fn run() -> Result<(), Box<dyn Error>> {
    // Real servers: the ones named by DATABASE_URL / NATS_URL, or fresh local ones.
    let pg = postgres().await?;
    let database = DatabaseArgs::from_url(pg.url());
    let broker = nats()?;
    // Shown with their passwords masked: DATABASE_URL and NATS_URL may hold
    // them.
    println!(
        "postgres: {}\nnats:     {}",
        database.redacted(),
        NatsArgs::new(broker.url()).redacted_url()
    );

    let pool = PgPool::connect_with(database.connect_options()?).await?;
    // The outbox's migrations, then this program's own table, under one
    // advisory lock: runs started together against one database take turns.
    outbox_pg::migrate_with(
        &pool,
        "create table if not exists subscriptions (
           id text primary key, customer_id text not null, plan text not null, amount_cents bigint not null);
         create table if not exists accounts (
           subscription_id text not null, plan text not null, opened_at timestamptz not null default now())",
    )
    .await?;
    let outbox = Outbox::new(SchemaRegistry::new().with_event::<SubscriptionCreated>()?);

    let run = std::process::id();
    let mut committed = Vec::new();
    for (i, plan) in ["basic", "pro", "team"].iter().enumerate() {
        let id = format!("sub_{run}_{i}");
        committed.push(create(&pool, &outbox, &id, plan, 1200 * (i as i64 + 1), true).await?);
    }
    // Rolled back: neither the row nor the event exists afterwards.
    create(
        &pool,
        &outbox,
        &format!("sub_{run}_rollback"),
        "pro",
        999,
        false,
    )
    .await?;
    // Invalid payload: refused before anything is written.
    match create(&pool, &outbox, &format!("sub_{run}_bad"), "pro", -5, true).await {
        Err(e) => println!("rejected:  {e}"),
        Ok(_) => return Err("a negative amount passed the schema".into()),
    }

    let nats_client = async_nats::connect(broker.url()).await?;
    let stream = StreamSpec::new("QUICKSTART", vec!["subscription.>".into()]);
    let relay = Relay::jetstream(
        pool.clone(),
        nats_client.clone(),
        &stream,
        RelayConfig::default(),
    )
    .await?;
    let report = relay.drain().await?;
    println!(
        "relay:     published {} (duplicates {}, failed {})",
        report.published, report.duplicates, report.failed
    );

    let js = jetstream::new(nats_client);
    let reader = js.clone();
    let consumer = reader
        .get_stream("QUICKSTART")
        .await?
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await?;
    let mut messages = consumer.messages().await?;
    let mut seen = Vec::new();
    while seen.len() < committed.len() {
        let Ok(Some(message)) = tokio::time::timeout(Duration::from_secs(5), messages.next()).await
        else {
            break;
        };
        let envelope = Envelope::<serde_json::Value>::from_json(&message?.payload)?;
        if committed.contains(&envelope.id().to_string()) {
            println!(
                "received:  {} {} {}",
                envelope.event_type(),
                envelope.subject(),
                envelope.data()
            );
            seen.push(envelope.id().to_string());
        }
    }
    // Three subscriptions, three subjects: each subject's events arrive in
    // order, but different subjects are published in parallel, in any order.
    seen.sort();
    let mut expected = committed.clone();
    expected.sort();
    if seen != expected {
        return Err(format!("expected {committed:?}, received {seen:?}").into());
    }
    println!(
        "ok: {} committed events delivered; nothing from the rollback or the invalid request",
        seen.len()
    );

    // The consuming side: one call assembles trace, metrics, the inbox and the
    // router, and subscribes to the handled type only.
    let stop = CancellationToken::new();
    let consuming = tokio::spawn(
        Consumer::builder(pool.clone(), js, "QUICKSTART", format!("quickstart_{run}"))
            .handler(OpenAccount)
            .run(stop.clone().cancelled_owned()),
    );
    let ids: Vec<String> = (0..committed.len())
        .map(|i| format!("sub_{run}_{i}"))
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let opened: i64 =
            sqlx::query_scalar("select count(*) from accounts where subscription_id = any($1)")
                .bind(&ids)
                .fetch_one(&pool)
                .await?;
        if opened == i64::try_from(ids.len())? {
            println!("consumed:  {opened} accounts opened, one per event, through the inbox");
            break;
        }
        if tokio::time::Instant::now() > deadline || consuming.is_finished() {
            return Err(format!("only {opened} of {} accounts opened", ids.len()).into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    consuming.await??;
    Ok(())
}

/// Inserts a subscription and its event in one transaction; commits or rolls back.
async fn create(
    pool: &PgPool,
    outbox: &Outbox,
    id: &str,
    plan: &str,
    amount_cents: i64,
    commit: bool,
) -> Result<String, Box<dyn Error>> {
    let mut tx = pool.begin().await?;
    sqlx::query("insert into subscriptions values ($1, 'cust_1', $2, $3)")
        .bind(id)
        .bind(plan)
        .bind(amount_cents)
        .execute(&mut *tx)
        .await?;
    let event = Envelope::event(
        "subscriptions",
        id,
        SubscriptionCreated {
            subscription_id: id.into(),
            customer_id: "cust_1".into(),
            plan: plan.into(),
            amount_cents,
        },
    )?;
    let event_id = outbox.enqueue(&mut tx, &event).await?;
    if commit {
        tx.commit().await?;
    } else {
        tx.rollback().await?;
    }
    Ok(event_id.to_string())
}
