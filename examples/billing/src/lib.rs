//! `billing`: an inbox consumer that raises exactly one invoice per
//! subscription, however often `subscription.created` is delivered, voids it
//! when the subscription is cancelled, and records the end of each trial that
//! runs out (`subscription.trial_ended`, a scheduled event).
//!
//! # Running it alone
//!
//! Against a running Postgres (billing's own database) and nats-server:
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/billing NATS_URL=nats://127.0.0.1:4222 \
//!   cargo run -p example-billing --bin billing -- --consumer billing --concurrency 16
//! # prints: billing ready
//! psql "$DATABASE_URL" -c 'select subscription_id, amount_cents, voided_at from invoices'
//! ```
//!
//! Start-up applies the outbox migrations (`outbox_events`, `inbox_events`,
//! `inbox_dead_letters`) and creates the `invoices` and `trial_ends` tables
//! if missing, all under one advisory lock so replicas started together take
//! turns, starts
//! an in-process relay for billing's own outbox (`invoice.created`; skip it
//! with `--no-relay`), then creates or updates the durable consumer
//! `--consumer` on `--stream`. The stream is created by whichever relay starts
//! first; if it does not exist yet, billing retries for up to 30 s before
//! failing. `billing ready` is printed on stdout once the consumer exists (a
//! standby replica prints it too, then waits for the lead). SIGTERM or
//! ctrl-c stops fetching, finishes, commits and acks the deliveries in hand,
//! stops the relay, and exits 0.
//!
//! | flag (env) | default | |
//! | --- | --- | --- |
//! | `--database-url` (`DATABASE_URL`) or `--database-url-file` (`DATABASE_URL_FILE`) | required | billing's database; TLS in the URL (`?sslmode=verify-full&sslrootcert=…`) |
//! | `--nats-url` (`NATS_URL`) | `nats://127.0.0.1:4222` | |
//! | `--nats-user`/`--nats-password`, `--nats-token`, `--nats-nkey` (each secret also as `--*-file`), `--nats-creds`, `--nats-tls-ca`, `--nats-tls-cert`/`--nats-tls-key` | | credentials and TLS, as for `outbox-relay` (docs/security.md, "Production connections") |
//! | `--consumer` | `billing` | durable name and inbox dedupe namespace |
//! | `--concurrency` | 16 | deliveries (or batches) handled at once by the leading replica (never two of one subscription) |
//! | `--batch` | 64 | most deliveries handled in one transaction (what has arrived, never waiting to fill one): up to N of distinct subscriptions share one inbox insert and one commit, then their acks; one whose handler fails is handled alone after it; 1: each in its own |
//! | `--start` | auto | where the durable starts if billing creates it: after the position the inbox records (nothing past the inbox window applied again), `all` (a replay), `new`, or a stream sequence |
//! | `--unordered` | | every replica consumes at once; a subscription's events may then be handled out of order across replicas (the handlers stay right, through retries) |
//! | `--lease-timeout` | 15s | how long a silent leader keeps the lead before a standby takes over (a dead process is replaced at once) |
//! | `--stream` (`OUTBOX_STREAM`) | `OUTBOX` | |
//! | `--subjects` (`OUTBOX_SUBJECTS`) | `subscription.>,invoice.>` | the stream's subjects, if billing's relay creates it |
//! | `--add-subjects`, `--stream-storage`, `--stream-replicas`, `--duplicate-window` | | what the relay's stream must be, as for `outbox-relay` (docs/relay.md) |
//! | `--no-relay` | | leave billing's outbox to a separate `outbox-relay` |
//! | `--max-deliver` | 50 | deliveries before a failing event is dead-lettered (billing counts them; the broker redelivers without limit, and a database that cannot be reached never spends them) |
//! | `--ack-wait` | 3s | how soon what a killed replica held is redelivered (a live one keeps its messages with in-progress acks, however slow its handlers); applied to an existing durable at start |
//! | `--metrics-addr` | | `/metrics` (Prometheus text), `/healthz`, `/readyz` (database, NATS, stream, durable consumer; 503 naming the failed check) |
//! | `--schemas` | `schemas/events` | where `invoice.created.schema.json` is |
//! | `--log-format` | `human` | or `json`; logs go to stderr |
//! | `--otlp-endpoint` (`OTEL_EXPORTER_OTLP_ENDPOINT`) | off | export spans over OTLP/HTTP to `URL/v1/traces` (docs/operations.md, "Tracing"); service name `OTEL_SERVICE_NAME`, default the binary's name |
//!
//! # What it does
//!
//! - [`InvoiceSubscription`] (`subscription.created`): inserts one row into
//!   `invoices` and enqueues `invoice.created` (subject: the subscription) in the
//!   delivery's transaction; a batch's creations together, in one insert and
//!   one outbox write (a [`BatchHandler`](inbox_consumer::BatchHandler)).
//!   `invoices.subscription_id` is deliberately not unique: the inbox alone
//!   prevents double invoices.
//! - [`VoidInvoices`] (`subscription.cancelled`): voids the subscription's
//!   invoice; if it has none yet, the cancellation is retried after a second,
//!   so it is applied only after the creation.
//! - [`RecordTrialEnd`] (`subscription.trial_ended`, a scheduled event the
//!   subscriptions service cancels when a trial is converted to paid first):
//!   records the trial's end in `trial_ends`, from when the subscription is
//!   charged. `trial_ends.subscription_id` is not unique either.
//!
//! Replicas of one `--consumer` run [ordered](inbox_consumer::ConsumerConfig::ordered):
//! one leads and consumes, the others stand by and take over when it dies, so
//! a subscription's creation and cancellation are never handled at the same
//! time and always in stream order. Both handlers also lock the subscription
//! and decide in one statement, so they stay right with `--unordered` too.
//!
//! The stack, outermost first: [`TraceLayer`] →
//! [`MetricsLayer`] → (test-only
//! [`CrashAfterCommit`]) → [`Dedupe`] → [`handlers`].
//!
//! # Test-only switches
//!
//! Hidden from `--help`; they exist so the end-to-end chaos run can prove its
//! checks catch what they must:
//!
//! - `--crash-after-commit P` (with `--seed N`): after each committed
//!   delivery, with probability `P`, `std::process::abort()` — the process
//!   dies between commit and ack ([`crash`]). The redelivery must be a
//!   duplicate.
//! - `--no-dedupe`: the handlers run in a plain transaction without the inbox
//!   row ([`Transactional`]), so redeliveries raise double invoices.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(warnings))))]

pub mod crash;
pub mod events;
mod handlers;
mod transactional;

use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream;
use inbox_consumer::{
    BatchResults, BoxError, Consumer, ConsumerConfig, Dedupe, Delivery, InTx, MetricsLayer,
    Outcome, Router, TraceLayer,
};
use outbox_pg::Outbox;
use sqlx::PgPool;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceBuilder};

pub use crash::{CrashAfterCommit, CrashAfterCommitLayer, CrashMode};
pub use handlers::{
    CANCEL_RETRY_AFTER, InvoiceSubscription, NotInvoicedYet, RecordTrialEnd, VoidInvoices,
};
pub use transactional::{Transactional, TransactionalLayer};

const CREATE_TABLE: &str = include_str!("../queries/create_invoices.sql");

/// The handlers, routed by event type, inside the delivery's transaction.
pub type Handlers = Router<InTx<Delivery>, InTx<Outcome>>;

/// A whole stack, boxed: what [`Consumer::run`] is given.
pub type Stack = BoxCloneSyncService<Delivery, Outcome, BoxError>;

/// Billing's handlers: `subscription.created` → [`InvoiceSubscription`],
/// `subscription.cancelled` → [`VoidInvoices`], `subscription.trial_ended` →
/// [`RecordTrialEnd`]. Follow-on events go through `outbox`, which should
/// validate against the `invoice.created` schema.
pub fn handlers(outbox: Outbox) -> Handlers {
    Router::new()
        .batch_handler(InvoiceSubscription::new(outbox))
        .handler(VoidInvoices::new())
        .handler(RecordTrialEnd::new())
}

/// How [`service`] builds the stack. Default: with the inbox, no crashes.
#[derive(Debug, Clone)]
pub struct StackOptions {
    dedupe: bool,
    crash: Option<CrashAfterCommitLayer>,
}

impl Default for StackOptions {
    fn default() -> Self {
        Self {
            dedupe: true,
            crash: None,
        }
    }
}

impl StackOptions {
    /// Whether the inbox dedupes deliveries. Default: true. `false` is for
    /// tests only (see [`Transactional`]).
    #[must_use]
    pub fn dedupe(mut self, on: bool) -> Self {
        self.dedupe = on;
        self
    }

    /// Puts `layer` just outside the transaction, to crash between commit and
    /// ack. Default: none. For tests only.
    #[must_use]
    pub fn crash_after_commit(mut self, layer: CrashAfterCommitLayer) -> Self {
        self.crash = Some(layer);
        self
    }
}

/// The consumer stack on `pool`: trace → metrics → (crash) → dedupe →
/// [`handlers`].
pub fn service(pool: PgPool, outbox: Outbox, options: StackOptions) -> Stack {
    let handlers = handlers(outbox);
    let transaction: Stack = if options.dedupe {
        BoxCloneSyncService::new(Dedupe::new(handlers, pool))
    } else {
        BoxCloneSyncService::new(TransactionalLayer::new(pool).layer(handlers))
    };
    BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(TraceLayer::new())
            .layer(MetricsLayer::new())
            .option_layer(options.crash)
            .service(transaction),
    )
}

/// A whole batch stack, boxed: what [`Consumer::run_batched`] is given.
pub type BatchStack = BoxCloneSyncService<Vec<Delivery>, BatchResults, BoxError>;

/// The batch stack on `pool` (for `--batch N` above 1): trace → metrics →
/// (crash) → dedupe of a whole batch in one transaction → [`handlers`].
///
/// # Errors
/// A message naming the conflict, with [`StackOptions::dedupe`] off: the
/// test-only stack without the inbox handles one delivery at a time.
pub fn batch_service(
    pool: PgPool,
    outbox: Outbox,
    options: StackOptions,
) -> Result<BatchStack, &'static str> {
    if !options.dedupe {
        return Err(
            "handling without the inbox (--no-dedupe) takes one delivery at a time (--batch 1)",
        );
    }
    let transaction: BatchStack = BoxCloneSyncService::new(Dedupe::new(handlers(outbox), pool));
    Ok(BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(TraceLayer::new())
            .layer(MetricsLayer::new())
            .option_layer(options.crash)
            .service(transaction),
    ))
}

/// The consumer `consumer` on `stream`, filtered to the event types billing
/// handles, [ordered](ConsumerConfig::ordered): a subscription's events are
/// handled one at a time, in stream order, whichever replica is up. Tune it
/// further with the [`ConsumerConfig`] setters.
pub fn consumer_config(stream: &str, consumer: &str) -> ConsumerConfig {
    ConsumerConfig::new(stream, consumer)
        .filter_subjects([
            events::SUBSCRIPTION_CANCELLED,
            events::SUBSCRIPTION_CREATED,
            events::SUBSCRIPTION_TRIAL_ENDED,
        ])
        .ordered(true)
}

/// [`Consumer::new_when_ready`]: the consumer, once the stream exists (it is
/// created by whichever relay starts first, and NATS may still be coming up),
/// waiting for at most `patience`.
///
/// # Errors
/// As [`Consumer::new_when_ready`].
pub async fn connect_consumer(
    js: jetstream::Context,
    pool: PgPool,
    config: ConsumerConfig,
    patience: Duration,
) -> inbox_consumer::Result<Consumer> {
    Consumer::new_when_ready(pool, js, config, Some(patience)).await
}

/// Applies the outbox migrations and creates the `invoices` and
/// `trial_ends` tables if they do not exist, all under
/// [`outbox_pg::migrate_with`]'s advisory lock, so replicas started together
/// on a fresh database prepare it one at a time.
///
/// # Errors
/// [`Error::Migrate`] if either step fails.
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    outbox_pg::migrate_with(pool, CREATE_TABLE).await?;
    // Under a role that may not create them, the tables are the owner's to
    // make (`outboxctl migrate --sql-dir examples/billing/migrations`).
    let missing: Vec<String> =
        sqlx::query_scalar("select t from unnest($1::text[]) t where to_regclass(t) is null")
            .bind(&["invoices", "trial_ends"][..])
            .fetch_all(pool)
            .await
            .map_err(|e| outbox_pg::Error::database("looking for billing's tables", e))?;
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::Migrate(outbox_pg::Error::new(
        outbox_pg::ErrorKind::Schema,
        format!(
            "billing's tables are missing ({}) and this role may not create them: run \
             `outboxctl migrate --sql-dir examples/billing/migrations` as the schema's owner",
            missing.join(", ")
        ),
    )))
}

/// A start-up failure: migrating the database.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The outbox migrations, or creating billing's tables, failed.
    #[error("migrating billing's database: {0}")]
    Migrate(#[from] outbox_pg::Error),
}

/// Where the event schemas are by default: `schemas/events` when it exists
/// (run from the repository root), else the workspace's `schemas/events`
/// next to this crate's sources (as under `cargo run` from anywhere).
pub fn default_schemas_dir() -> PathBuf {
    let relative = PathBuf::from("schemas/events");
    if relative.is_dir() {
        relative
    } else {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../schemas/events"))
    }
}
