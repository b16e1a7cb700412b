//! The write side of a transactional outbox: a CloudEvents envelope, an API that
//! appends events to `outbox_events` inside the caller's Postgres transaction, and
//! JSON Schema validation of payloads.
//!
//! A service writes its domain row and its event in **one** transaction. If the
//! transaction rolls back, the event never existed; if it commits, the event is
//! durable and a relay (`outbox-publisher`) delivers it to NATS JetStream, at
//! least once, with the same id on every retry.
//!
//! This crate depends on neither NATS nor tower: applications link it alone.
//!
//! # Getting started
//!
//! ```no_run
//! use outbox_pg::prelude::*;
//! use serde::{Deserialize, Serialize};
//!
//! /// A customer subscribed to a plan.
//! #[derive(Serialize, Deserialize, JsonSchema)]
//! struct SubscriptionCreated { subscription_id: String, plan: String, amount_cents: i64 }
//!
//! // The type string, the payload and its schema (derived), declared once.
//! impl Event for SubscriptionCreated {
//!     const TYPE: &'static str = "subscription.created"; // type, and the NATS subject
//! }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://localhost/app").await?;
//! outbox_pg::migrate(&pool).await?;
//! let outbox = Outbox::new(SchemaRegistry::new().with_event::<SubscriptionCreated>()?);
//!
//! let mut tx = pool.begin().await?;
//! sqlx::query("insert into subscriptions (id, plan) values ($1, $2)")
//!     .bind("sub_1").bind("pro")
//!     .execute(&mut *tx).await?;
//! let event = Envelope::event(
//!     "subscriptions",             // source: this service
//!     "sub_1",                     // subject: the entity
//!     SubscriptionCreated { subscription_id: "sub_1".into(), plan: "pro".into(), amount_cents: 1234 },
//! )?;
//! let id = outbox.enqueue(&mut tx, &event).await?; // validated against its schema
//! tx.commit().await?;                              // row and event, or neither
//! # let _ = id; Ok(()) }
//! ```
//!
//! Untyped events work too: `Envelope::new("subscription.created", source,
//! subject, serde_json::json!({…}))`, validated by a registry read from
//! `<type>.schema.json` files ([`SchemaRegistry::from_dir`]).
//!
//! # Guarantees
//!
//! - The event row commits or rolls back with the caller's transaction: every
//!   write takes `&mut PgTransaction`.
//! - The id (UUID v7) is generated before the insert and returned; the relay
//!   publishes it as the CloudEvents `id` and the `Nats-Msg-Id` header.
//! - A payload that fails its schema, or an event type without one, is refused
//!   with an error naming the type, the JSON pointer and the reason; nothing is
//!   written.
//! - So is every event the relay could not publish or a consumer could not
//!   decode: a type in a NATS reserved namespace (`$JS.…`, `_INBOX.…`), a
//!   malformed `traceparent` or `tracestate` (they travel as headers), a `time`
//!   whose year has more than four digits, `data` with a number beyond a 64-bit
//!   float or nested too deep, and a message larger than
//!   [`Outbox::max_message_size`] ([`ErrorKind::TooLarge`]). The rules are
//!   public functions ([`validate_traceparent`], [`check_json_decodable`], …) so
//!   the relay applies the same ones to rows written by other clients.
//! - The relay numbers events in insert order and sends the number as the
//!   CloudEvents `sequence` extension ([`Envelope::sequence`],
//!   [`format_sequence`]).
//! - [`Outbox::enqueue_all`] writes any number of events in one statement.
//!
//! # Features
//!
//! - `migrate` (default): [`MIGRATOR`] and [`migrate`], the embedded schema.
//! - `connect` (off): [`connect`], the flags and environment variables a
//!   binary reaches PostgreSQL and NATS with (secrets from env or files, TLS)
//!   and shutdown on a signal, shared by the relay and consumer services;
//!   adds async-nats, clap and tokio's signal handling.
//! - `signal` (off; on with `connect`, and in `inbox-consumer` and
//!   `outbox-publisher`, which re-export it): `shutdown_signal()`, resolving
//!   on SIGTERM or ctrl-c.
//! - `opentelemetry` (off): `trace_context`, W3C trace context from and to
//!   the OpenTelemetry context of `tracing` spans (through
//!   `tracing-opentelemetry` and the SDK's TraceContext propagator).
//!   [`Outbox::enqueue`] then writes the current span's context on an event
//!   that carries none, and `Envelope::with_current_trace_context` sets it
//!   explicitly, so the spans of the event's handlers join the writer's trace.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![doc(test(attr(deny(warnings))))]

#[cfg(feature = "connect")]
pub mod connect;
mod envelope;
pub mod error;
pub mod event;
pub mod failure;
pub mod health;
mod human;
mod jsonb;
mod layout;
#[cfg(feature = "migrate")]
mod migrate;
mod namespace;
#[cfg(feature = "nats")]
pub mod nats;
mod outbox;
pub mod pooler;
pub mod privilege;
pub mod ready;
mod schedule;
mod schema;
mod sequence;
#[cfg(feature = "signal")]
mod signal;
#[cfg(feature = "opentelemetry")]
pub mod trace_context;
mod validate;

/// The user guide's chapters on writing events, rendered here from the
/// repository's `docs/`.
pub mod guide {
    #[doc = include_str!("../docs/guarantees.md")]
    pub mod guarantees {}
    #[doc = include_str!("../docs/schema.md")]
    pub mod schema {}
    #[doc = include_str!("../docs/scheduling.md")]
    pub mod scheduling {}
    #[doc = include_str!("../docs/security.md")]
    pub mod security {}
    #[doc = include_str!("../docs/wire.md")]
    pub mod wire {}
}

pub mod prelude;

pub use envelope::{
    DATA_CONTENT_TYPE, Envelope, EventId, EventType, PLATFORM_SUBJECT, SPEC_VERSION,
};
pub use error::{BoxError, Error, ErrorKind, Result, Violation};
pub use event::{Event, check_schema_file};
pub use failure::sqlstate;
pub use human::{HumanDuration, db_error_text, error_line, exit_code};
pub use layout::{
    SCHEMA_WAIT, SHARDS, check_inbox_layout, check_inbox_layout_at_start, check_outbox_layout,
    check_outbox_layout_at_start,
};
#[cfg(feature = "migrate")]
pub use migrate::{
    AppSql, MIGRATION_LOCK, MIGRATION_TABLE, MIGRATOR, Migrated, explain_migrate_error, migrate,
    migrate_report, migrate_with,
};
pub use namespace::Namespace;
pub use outbox::{DEFAULT_MAX_MESSAGE_SIZE, Outbox};
pub use pooler::{require_sessions, require_sessions_at_start};
pub use privilege::{
    Privilege, check_privileges, check_privileges_at_start, is_insufficient_privilege,
};
pub use schedule::{Cancellation, Due};
pub use schema::{SCHEMA_SUFFIX, SchemaRegistry};
/// The crate [`Event`] derives schemas with, re-exported so a service uses
/// the same version (`#[derive(outbox_pg::schemars::JsonSchema)]`).
pub use schemars;
pub use sequence::{SEQUENCE_WIDTH, format_sequence, parse_sequence};
#[cfg(feature = "signal")]
pub use signal::shutdown_signal;
pub use validate::{
    MAX_ATTRIBUTE_LEN, MAX_EVENT_TYPE_LEN, MAX_JSON_DEPTH, MAX_TRACESTATE_LEN,
    check_json_decodable, validate_event_type, validate_time, validate_traceparent,
    validate_tracestate,
};

/// The crate README's examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
