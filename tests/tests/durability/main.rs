//! What the relay does about a stream that can lose what it acknowledged,
//! against real PostgreSQL and nats-server: the audit that reads published rows
//! back from the stream and republishes the lost, and the durability stated at
//! start. Each module says what it covers.

#[path = "../support/mod.rs"]
mod support;

mod audit;
mod statement;
