//! Least-privilege database roles (`ops/sql/roles.sql`) and consumers kept
//! apart by row-level security, against real PostgreSQL. Each module says what
//! it covers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a failed step is a failed test

#[path = "../support/mod.rs"]
mod support;

mod grants;
mod isolation;
