//! The events billing reads and the one it writes.
//!
//! Billing decodes only the fields it uses and ignores the rest (a tolerant
//! reader): the publisher may add fields without breaking it.

use chrono::{DateTime, Utc};
use outbox_pg::Event;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Event type billing raises an invoice for.
pub const SUBSCRIPTION_CREATED: &str = SubscriptionCreated::TYPE;
/// Event type billing voids invoices for.
pub const SUBSCRIPTION_CANCELLED: &str = SubscriptionCancelled::TYPE;
/// Event type billing records a trial's end for.
pub const SUBSCRIPTION_TRIAL_ENDED: &str = SubscriptionTrialEnded::TYPE;
/// Event type billing writes when it raises an invoice.
pub const INVOICE_CREATED: &str = InvoiceCreated::TYPE;
/// `source` of the events billing writes.
pub const SOURCE: &str = "billing";

/// `data` of `subscription.created`, as billing reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SubscriptionCreated {
    /// The subscription to invoice.
    pub subscription_id: String,
    /// Its customer.
    pub customer_id: String,
    /// The price, in cents.
    pub amount_cents: i64,
}

/// `data` of `subscription.cancelled`, as billing reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SubscriptionCancelled {
    /// The cancelled subscription.
    pub subscription_id: String,
}

/// `data` of `subscription.trial_ended`, as billing reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SubscriptionTrialEnded {
    /// The subscription whose trial ran out.
    pub subscription_id: String,
    /// Its customer.
    pub customer_id: String,
    /// When the trial ended: billing charges from then.
    #[schemars(with = "String", extend("format" = "date-time"))]
    pub trial_ended_at: DateTime<Utc>,
}

/// `data` of `invoice.created` (`schemas/events/invoice.created.schema.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(description = "An invoice was raised for a subscription.")]
pub struct InvoiceCreated {
    /// The new invoice.
    #[schemars(length(min = 1))]
    pub invoice_id: String,
    /// The subscription it bills; also the envelope subject.
    #[schemars(length(min = 1))]
    pub subscription_id: String,
    /// The customer billed.
    #[schemars(length(min = 1))]
    pub customer_id: String,
    /// The amount, in cents.
    #[schemars(range(min = 0))]
    pub amount_cents: i64,
}

impl Event for SubscriptionCreated {
    const TYPE: &'static str = "subscription.created";
}

impl Event for SubscriptionCancelled {
    const TYPE: &'static str = "subscription.cancelled";
}

impl Event for SubscriptionTrialEnded {
    const TYPE: &'static str = "subscription.trial_ended";
}

impl Event for InvoiceCreated {
    const TYPE: &'static str = "invoice.created";
}
