//! The events this service publishes, and how their envelopes are built.
//!
//! Both events use the **customer id as the envelope `subject`**, not the
//! subscription id. The subject is the unit of ordering: the relay never
//! publishes an event while an earlier unpublished one of the same subject
//! exists, and the inbox runtime handles one subject's deliveries one at a
//! time, in stream order. Billing keeps per-customer state (a customer's
//! invoices, a cancellation voiding the invoice that its creation raised), so
//! it needs each customer's events in the order they were committed here;
//! keying on the customer gives exactly that, while different customers still
//! flow in parallel. The price: one customer's events are serialised, and an
//! event stuck for a customer holds back that customer's later events only.

use outbox_core::{Envelope, Result};
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
    /// The new subscription.
    pub subscription_id: String,
    /// The customer who subscribed; also the envelope subject.
    pub customer_id: String,
    /// The plan subscribed to.
    pub plan: String,
    /// The price, in cents.
    pub amount_cents: i64,
}

/// `data` of `subscription.cancelled` (`schemas/events/subscription.cancelled.schema.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscriptionCancelled {
    /// The cancelled subscription.
    pub subscription_id: String,
    /// Its customer; also the envelope subject.
    pub customer_id: String,
}

/// The `subscription.created` envelope for `data`, with the customer as subject.
///
/// # Errors
/// [`outbox_core::ErrorKind::InvalidEnvelope`] if the customer id is not a
/// usable subject (blank, too long, control characters).
pub fn created(data: SubscriptionCreated) -> Result<Envelope<SubscriptionCreated>> {
    let subject = data.customer_id.clone();
    Envelope::new(CREATED, SOURCE, subject, data)
}

/// The `subscription.cancelled` envelope for `data`, with the customer as subject.
///
/// # Errors
/// As [`created`].
pub fn cancelled(data: SubscriptionCancelled) -> Result<Envelope<SubscriptionCancelled>> {
    let subject = data.customer_id.clone();
    Envelope::new(CANCELLED, SOURCE, subject, data)
}
