//! The relay against real PostgreSQL and nats-server: the library (`Relay`),
//! and the `outbox-relay` binary under faults (broker down, kill -9,
//! replicas, poison rows). Each module says what it covers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[path = "../support/mod.rs"]
mod support;

mod faults;
mod library;
