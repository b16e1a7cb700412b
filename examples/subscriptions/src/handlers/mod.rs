//! The HTTP handlers, one module per endpoint.

pub(crate) mod cancel;
pub(crate) mod convert;
pub(crate) mod create;
pub(crate) mod health;
pub(crate) mod read;

use chrono::{DateTime, Utc};
use serde::Serialize;

/// The answer of a write: the subscription and the event written with it.
#[derive(Debug, Clone, Serialize)]
pub struct Written {
    /// The subscription id.
    pub id: String,
    /// The id of the event committed in the same transaction.
    pub event_id: String,
    /// A subscription created with a trial: the id of its scheduled
    /// `subscription.trial_ended`, committed in the same transaction.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trial_event_id: Option<String>,
    /// A subscription created with a trial: when the trial ends.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trial_ends_at: Option<DateTime<Utc>>,
}

impl Written {
    /// The answer of a write of `id` and the event `event_id`.
    pub(crate) fn new(id: String, event_id: impl ToString) -> Self {
        Self {
            id,
            event_id: event_id.to_string(),
            trial_event_id: None,
            trial_ends_at: None,
        }
    }
}
