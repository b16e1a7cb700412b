//! The deployments production runs, beyond one outbox on one direct
//! connection: several outboxes in one database (`tenants`), connection
//! poolers (`poolers`), drains beside other relays (`once`), settings that
//! break the relay (`settings`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[allow(dead_code)] // this file runs the relay, billing and subscriptions only
mod support;

#[path = "deployments/once.rs"]
mod once;
#[path = "deployments/poolers.rs"]
mod poolers;
#[path = "deployments/settings.rs"]
mod settings;
#[path = "deployments/tenants.rs"]
mod tenants;
