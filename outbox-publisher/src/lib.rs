//! The outbox relay (see the crate README).
