//! Least-privilege database roles (`ops/sql/roles.sql`) and consumers kept
//! apart by row-level security, against real PostgreSQL. Each module says what
//! it covers.

#[path = "../support/mod.rs"]
mod support;

mod grants;
mod isolation;
mod snippet;
