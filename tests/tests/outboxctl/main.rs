//! `outboxctl` against real PostgreSQL and nats-server: the outbox commands,
//! the scheduled events' commands, and the inbox and dead-letter commands.
//! Each module says what it covers.

#[path = "../support/mod.rs"]
mod support;

mod inbox;
mod migrate;
mod outbox;
mod schedule;
