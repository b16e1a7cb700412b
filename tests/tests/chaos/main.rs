//! The chaos runs (`outbox-demo --chaos`, ignored: run with `--ignored`) and
//! the checker that judges them, against real servers. Each module says what
//! it covers.

#[path = "../support/mod.rs"]
mod support;

mod checker;
mod runs;
