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

use outbox_pg::{Envelope, Event, Result};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `source` of every event this service writes.
pub const SOURCE: &str = "subscriptions";
/// Event type written when a subscription is created.
pub const CREATED: &str = SubscriptionCreated::TYPE;
/// Event type written when a subscription is cancelled.
pub const CANCELLED: &str = SubscriptionCancelled::TYPE;

/// `data` of `subscription.created`: the type, and its schema, which is also
/// kept as `schemas/events/subscription.created.schema.json` for other
/// languages (a test checks the file against the type).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(description = "A customer subscribed to a plan.")]
pub struct SubscriptionCreated {
    /// The new subscription; also the envelope subject.
    #[schemars(length(min = 1))]
    pub subscription_id: String,
    /// The customer who subscribed.
    #[schemars(length(min = 1))]
    pub customer_id: String,
    /// The plan subscribed to.
    #[schemars(length(min = 1, max = 64))]
    pub plan: String,
    /// The price, in cents.
    #[schemars(range(min = 0))]
    pub amount_cents: i64,
}

impl Event for SubscriptionCreated {
    const TYPE: &'static str = "subscription.created";
}

/// `data` of `subscription.cancelled` (kept as
/// `schemas/events/subscription.cancelled.schema.json` too).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(description = "A customer cancelled a subscription.")]
pub struct SubscriptionCancelled {
    /// The cancelled subscription; also the envelope subject.
    #[schemars(length(min = 1))]
    pub subscription_id: String,
    /// Its customer.
    #[schemars(length(min = 1))]
    pub customer_id: String,
}

impl Event for SubscriptionCancelled {
    const TYPE: &'static str = "subscription.cancelled";
}

/// The `subscription.created` envelope for `data`, with the subscription as subject.
///
/// # Errors
/// [`outbox_pg::ErrorKind::InvalidEnvelope`] if the subscription id is not a
/// usable subject (blank, too long, control characters).
pub fn created(data: SubscriptionCreated) -> Result<Envelope<SubscriptionCreated>> {
    let subject = data.subscription_id.clone();
    Envelope::event(SOURCE, subject, data)
}

/// The `subscription.cancelled` envelope for `data`, with the subscription as subject.
///
/// # Errors
/// As [`created`].
pub fn cancelled(data: SubscriptionCancelled) -> Result<Envelope<SubscriptionCancelled>> {
    let subject = data.subscription_id.clone();
    Envelope::event(SOURCE, subject, data)
}
