//! What operators run against: the binaries' metrics, health and readiness
//! endpoints, and the Prometheus alert rules (promtool). Each module says what
//! it covers.

#[path = "../support/mod.rs"]
mod support;

mod binaries;
mod rules;
