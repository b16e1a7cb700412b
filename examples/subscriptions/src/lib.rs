//! `subscriptions`: an HTTP service that writes each subscription and its event
//! in **one** Postgres transaction, with an in-process relay that moves the
//! events to NATS JetStream.
//!
//! # Running it alone
//!
//! Against a running Postgres and nats-server (JetStream enabled):
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/subscriptions NATS_URL=nats://127.0.0.1:4222 \
//!   cargo run -p example-subscriptions --bin subscriptions -- --listen 127.0.0.1:8080
//! # prints: listening on http://127.0.0.1:8080
//!
//! curl -s localhost:8080/v1/subscriptions -H 'content-type: application/json' \
//!   -d '{"customer_id": "cus_1", "plan": "pro", "amount_cents": 1234}'
//! # {"id":"sub_0199…","event_id":"0199…"}
//! curl -s localhost:8080/v1/subscriptions/sub_0199…
//! curl -s -X POST localhost:8080/v1/subscriptions/sub_0199…/cancel
//!
//! curl -s localhost:8080/v1/subscriptions -H 'content-type: application/json' \
//!   -d '{"customer_id": "cus_2", "plan": "pro", "amount_cents": 1234, "trial": true}'
//! # {"id":"sub_0199…","event_id":"0199…","trial_event_id":"0199…","trial_ends_at":"…"}
//! curl -s -X POST localhost:8080/v1/subscriptions/sub_0199…/convert
//! # {"id":"sub_0199…","cancelled_event_id":"0199…"}
//! ```
//!
//! Start-up applies the outbox migrations and creates the `subscriptions`
//! table (and its trial columns) if missing, one replica at a time ([`migrate`]). The relay creates
//! the stream (`--stream`, `--subjects`) if it does not exist; `--no-relay`
//! leaves publishing to a separate `outbox-relay`. SIGTERM or ctrl-c stops
//! accepting requests, finishes those in flight and the relay's current
//! batch, and exits 0.
//!
//! | flag (env) | default | |
//! | --- | --- | --- |
//! | `--database-url` (`DATABASE_URL`) or `--database-url-file` (`DATABASE_URL_FILE`) | required | this service's database; TLS in the URL (`?sslmode=verify-full&sslrootcert=…`) |
//! | `--listen` | `127.0.0.1:8080` | port 0 picks a free port; stdout says `listening on http://ADDR` |
//! | `--nats-url` (`NATS_URL`) | `nats://127.0.0.1:4222` | for the in-process relay |
//! | `--nats-user`/`--nats-password`, `--nats-token`, `--nats-nkey` (each secret also as `--*-file`), `--nats-creds`, `--nats-tls-ca`, `--nats-tls-cert`/`--nats-tls-key` | | credentials and TLS, as for `outbox-relay` (docs/security.md, "Production connections") |
//! | `--no-relay` | | publish with a separate `outbox-relay` instead |
//! | `--stream` (`OUTBOX_STREAM`) | `OUTBOX` | |
//! | `--subjects` (`OUTBOX_SUBJECTS`) | `subscription.>,invoice.>` | the stream's subjects, if the relay creates it |
//! | `--add-subjects`, `--stream-storage`, `--stream-replicas`, `--duplicate-window` | | what the relay's stream must be, as for `outbox-relay` (docs/relay.md) |
//! | `--schemas` | `schemas/events` | the event schemas (falls back to the workspace's) |
//! | `--trial-period` (`TRIAL_PERIOD`) | `14days` | how long a trial lasts (`30s`, `2h`, `14days`): its `subscription.trial_ended` falls due then |
//! | `--fault-injection` | off | honour `x-fault: rollback` (tests and demos only) |
//! | `--metrics-addr` | | `/metrics` (the in-process relay's), `/healthz`, `/readyz` (database; with the relay, NATS and the stream) |
//! | `--log-format` | `human` | or `json`; logs go to stderr |
//! | `--otlp-endpoint` (`OTEL_EXPORTER_OTLP_ENDPOINT`) | off | export spans over OTLP/HTTP to `URL/v1/traces` (docs/operations.md, "Tracing"); service name `OTEL_SERVICE_NAME`, default the binary's name |
//!
//! # API
//!
//! | request | answer |
//! | --- | --- |
//! | `POST /v1/subscriptions` `{"customer_id", "plan", "amount_cents"}` | `201 {"id", "event_id"}`: the row and `subscription.created`, committed together |
//! | the same with `"trial": true` | `201 {"id", "event_id", "trial_event_id", "trial_ends_at"}`: also `subscription.trial_ended`, scheduled for the trial's end (`--trial-period` from now), and its id stored with the row, all committed together |
//! | `POST /v1/subscriptions/{id}/convert` | `200 {"id", "cancelled_event_id"}`: the trial converted to paid (`converted_at`) and its `subscription.trial_ended` cancelled, together; `409` if the trial has ended already (the event was published, or is being published), the subscription has no trial, is converted already or cancelled; `404` unknown |
//! | `POST /v1/subscriptions/{id}/cancel` | `200 {"id", "event_id"}`: status `cancelled` and `subscription.cancelled`, together, and a trial's `subscription.trial_ended` cancelled unless already published; `404` unknown, `409` already cancelled |
//! | `GET /v1/subscriptions/{id}` | `200` the row, `404` |
//! | `GET /healthz` | `200` when the database answers, else `503` |
//!
//! Every error is JSON, `{"error": "…"}`. A body that is not acceptable —
//! malformed JSON, a missing, unknown or mistyped field, a blank id or plan, a
//! negative amount, a payload the event schema refuses — answers `422` with a
//! message naming the field or JSON pointer, and nothing is written.
//!
//! The events' envelope subject is the subscription id (see [`events`] for why).
//!
//! # Tracing
//!
//! Each request runs in an `http.request` span, and its event is written with
//! that span's trace context (`traceparent`), so with the binary's OTLP
//! exporter on (`--otlp-endpoint`) the relay's message and billing's handling
//! of it show in the request's trace. A request carrying a W3C `traceparent`
//! header continues the caller's trace.
//!
//! # Fault injection
//!
//! Started with `--fault-injection`, a write request carrying
//! `x-fault: rollback` does every write (row and event) and then rolls the
//! transaction back, answering `500 {"error": "injected rollback", "id": …}`
//! with the id the subscription would have had. Tests use it to check that a
//! rolled-back request leaves no event behind. Without the flag the header is
//! ignored.
//!
//! # As a library
//!
//! [`router`] builds the axum app on an [`AppState`]; [`migrate`] prepares a
//! database; the binary runs its relay with [`outbox_publisher::Relay::run_jetstream`]. Tests drive the
//! router in-process.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(warnings))))]

mod error;
pub mod events;
mod extract;
mod handlers;
mod state;
mod trace;

use std::path::PathBuf;

use axum::Router;
use axum::routing::{get, post};
use sqlx::PgPool;

pub use error::{ApiError, Error};
pub use extract::ApiJson;
pub use handlers::Written;
pub use handlers::convert::Converted;
pub use handlers::create::{NewSubscription, new_subscription_id};
pub use handlers::read::Subscription;
pub use state::{AppState, DEFAULT_TRIAL_PERIOD, FAULT_HEADER};

const CREATE_TABLE: &str = include_str!("../queries/create_subscriptions.sql");

/// The HTTP API (see the [crate docs](crate)).
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/subscriptions", post(handlers::create::create))
        .route("/v1/subscriptions/{id}", get(handlers::read::get))
        .route(
            "/v1/subscriptions/{id}/cancel",
            post(handlers::cancel::cancel),
        )
        .route(
            "/v1/subscriptions/{id}/convert",
            post(handlers::convert::convert),
        )
        .route("/healthz", get(handlers::health::healthz))
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .layer(axum::middleware::from_fn(trace::request_span))
        .with_state(state)
}

/// Applies the outbox migrations (`outbox_events`, `inbox_events`) and
/// creates the `subscriptions` table and its trial columns if they do not exist, both under
/// [`outbox_pg::migrate_with`]'s advisory lock, so replicas started together
/// on a fresh database prepare it one at a time.
///
/// # Errors
/// [`Error::Migrate`] if either step fails.
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    outbox_pg::migrate_with(pool, CREATE_TABLE).await?;
    // Under a role that may not create them, the tables are the owner's to
    // make (`outboxctl migrate --sql-dir examples/subscriptions/migrations`).
    let missing: Vec<String> =
        sqlx::query_scalar("select t from unnest($1::text[]) t where to_regclass(t) is null")
            .bind(&["subscriptions"][..])
            .fetch_all(pool)
            .await
            .map_err(|e| outbox_pg::Error::database("looking for subscriptions' tables", e))?;
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::Migrate(outbox_pg::Error::new(
        outbox_pg::ErrorKind::Schema,
        format!(
            "subscriptions' tables are missing ({}) and this role may not create them: run \
             `outboxctl migrate --sql-dir examples/subscriptions/migrations` as the schema's owner",
            missing.join(", ")
        ),
    )))
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
