//! The inbox consumer.
