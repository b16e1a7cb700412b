//! `outboxctl` against real PostgreSQL and nats-server: the outbox commands and
//! the inbox and dead-letter commands. Each module says what it covers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[path = "../support/mod.rs"]
mod support;

mod inbox;
mod outbox;
