//! The HTTP handlers, one module per endpoint.

pub(crate) mod cancel;
pub(crate) mod create;
pub(crate) mod health;
pub(crate) mod read;

use serde::Serialize;

/// The answer of a write: the subscription and the event written with it.
#[derive(Debug, Clone, Serialize)]
pub struct Written {
    /// The subscription id.
    pub id: String,
    /// The id of the event committed in the same transaction.
    pub event_id: String,
}
