//! What operators run against: the binaries' metrics, health and readiness
//! endpoints, and the Prometheus alert rules (promtool). Each module says what
//! it covers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[path = "../support/mod.rs"]
mod support;

mod binaries;
mod rules;
