//! The events billing reads and the one it writes.
//!
//! Billing decodes only the fields it uses and ignores the rest (a tolerant
//! reader): the publisher may add fields without breaking it.

use serde::{Deserialize, Serialize};

/// Event type billing raises an invoice for.
pub const SUBSCRIPTION_CREATED: &str = "subscription.created";
/// Event type billing voids invoices for.
pub const SUBSCRIPTION_CANCELLED: &str = "subscription.cancelled";
/// Event type billing writes when it raises an invoice.
pub const INVOICE_CREATED: &str = "invoice.created";
/// `source` of the events billing writes.
pub const SOURCE: &str = "billing";

/// `data` of `subscription.created`, as billing reads it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SubscriptionCreated {
    /// The subscription to invoice.
    pub subscription_id: String,
    /// Its customer.
    pub customer_id: String,
    /// The price, in cents.
    pub amount_cents: i64,
}

/// `data` of `subscription.cancelled`, as billing reads it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SubscriptionCancelled {
    /// The cancelled subscription.
    pub subscription_id: String,
}

/// `data` of `invoice.created` (`schemas/events/invoice.created.schema.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InvoiceCreated {
    /// The new invoice.
    pub invoice_id: String,
    /// The subscription it bills; also the envelope subject.
    pub subscription_id: String,
    /// The customer billed.
    pub customer_id: String,
    /// The amount, in cents.
    pub amount_cents: i64,
}
