//! The relay against real PostgreSQL and nats-server: the library (`Relay`),
//! and the `outbox-relay` binary under faults (broker down, kill -9,
//! replicas, poison rows). Each module says what it covers.

#[path = "../support/mod.rs"]
mod support;

mod faults;
mod library;
mod scheduled;
