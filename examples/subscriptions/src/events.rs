//! The events this service publishes, and how their envelopes are built.
//!
//! Both events use the **subscription id as the envelope `subject`**: the
//! subscription is the entity they describe. The subject is the unit of
//! ordering: the relay never publishes an event while an earlier unpublished
//! one of the same subject exists, and the inbox runtime handles one subject's
//! deliveries one at a time, in stream order. A subscription's events are
//! written one after the other (created, then cancelled), so created_at order
//! is their commit order and consumers see `subscription.created` before
//! `subscription.cancelled`. Different subscriptions, even of one customer,
//! are independent and flow in parallel: nothing billing does depends on the
//! order of two subscriptions.

use outbox_pg::{Envelope, Result};
use serde::{Deserialize, Serialize};

/// `source` of every event this service writes.
pub const SOURCE: &str = "subscriptions";
/// Event type written when a subscription is created.
pub const CREATED: &str = "subscription.created";
/// Event type written when a subscription is cancelled.
pub const CANCELLED: &str = "subscription.cancelled";

/// `data` of `subscription.created` (`schemas/events/subscription.created.schema.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscriptionCreated {
    /// The new subscription; also the envelope subject.
    pub subscription_id: String,
    /// The customer who subscribed.
    pub customer_id: String,
    /// The plan subscribed to.
    pub plan: String,
    /// The price, in cents.
    pub amount_cents: i64,
}

/// `data` of `subscription.cancelled` (`schemas/events/subscription.cancelled.schema.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscriptionCancelled {
    /// The cancelled subscription; also the envelope subject.
    pub subscription_id: String,
    /// Its customer.
    pub customer_id: String,
}

/// The `subscription.created` envelope for `data`, with the subscription as subject.
///
/// # Errors
/// [`outbox_pg::ErrorKind::InvalidEnvelope`] if the subscription id is not a
/// usable subject (blank, too long, control characters).
pub fn created(data: SubscriptionCreated) -> Result<Envelope<SubscriptionCreated>> {
    let subject = data.subscription_id.clone();
    Envelope::new(CREATED, SOURCE, subject, data)
}

/// The `subscription.cancelled` envelope for `data`, with the subscription as subject.
///
/// # Errors
/// As [`created`].
pub fn cancelled(data: SubscriptionCancelled) -> Result<Envelope<SubscriptionCancelled>> {
    let subject = data.subscription_id.clone();
    Envelope::new(CANCELLED, SOURCE, subject, data)
}
