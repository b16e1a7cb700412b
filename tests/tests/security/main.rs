//! The shipped binaries with production connections, against servers set up
//! that way: TLS, credentials from files and the environment, secrets never
//! logged, each NATS user allowed what its component does and no more. Each
//! module says what it covers.

#[path = "../support/mod.rs"]
mod support;

mod nats_permissions;
mod secrets;
mod secure;
