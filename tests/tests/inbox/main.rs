//! The inbox against real PostgreSQL and nats-server, one test binary: the
//! consumer's promises (dedupe, ack after commit, retries, dead letters,
//! order, replicas, consume → produce), the runtime under load, set-based
//! handlers, panics, a lone event handled at once, where a new durable
//! starts, and dead-letter retention.
//! Each module says what it covers; `world` is what they share.

#[path = "../support/mod.rs"]
mod support;

mod batch_handler;
mod consumer;
mod dead_letter_retention;
mod panics;
mod prompt;
mod runtime;
mod starts;
mod world;
