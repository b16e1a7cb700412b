//! Integration tests live in `tests/`.

/// The workspace README's Rust snippets, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

/// The Rust snippets of the guides in `docs/`, compiled as doc tests.
#[cfg(doctest)]
pub mod docs {
    /// `docs/schema.md`: the table, the migrations, bounded tables.
    #[doc = include_str!("../../docs/schema.md")]
    pub mod schema {}

    /// `docs/security.md`: least privilege, production connections.
    #[doc = include_str!("../../docs/security.md")]
    pub mod security {}

    /// `docs/relay.md`: running the relay in full.
    #[doc = include_str!("../../docs/relay.md")]
    pub mod relay {}

    /// `docs/guarantees.md`: what writes, the relay and ordered consumers guarantee.
    #[doc = include_str!("../../docs/guarantees.md")]
    pub mod guarantees {}

    /// `docs/cluster.md`: a JetStream cluster with an R3 stream.
    #[doc = include_str!("../../docs/cluster.md")]
    pub mod cluster {}

    /// `docs/consuming.md`: the consumer runtime in full.
    #[doc = include_str!("../../docs/consuming.md")]
    pub mod consuming {}

    /// `docs/operations.md`: metrics, tracing, health, the dashboard, `outboxctl`.
    #[doc = include_str!("../../docs/operations.md")]
    pub mod operations {}

    /// `docs/alerts.md`: the alerts and their runbooks.
    #[doc = include_str!("../../docs/alerts.md")]
    pub mod alerts {}

    /// `docs/testing.md`: the test suite, changing SQL.
    #[doc = include_str!("../../docs/testing.md")]
    pub mod testing {}
}
