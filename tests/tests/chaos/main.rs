//! The chaos runs (`outbox-demo --chaos`, ignored: run with `--ignored`) and
//! the checker that judges them, against real servers. Each module says what
//! it covers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[path = "../support/mod.rs"]
mod support;

mod checker;
mod runs;
