//! Integration tests live in `tests/`.

/// The workspace README's Rust snippets, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
