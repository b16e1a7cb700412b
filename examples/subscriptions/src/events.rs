//! The events this service publishes, and how their envelopes are built.
//!
//! Every event uses the **subscription id as the envelope `subject`**: the
//! subscription is the entity they describe. The subject is the unit of
//! ordering: the relay never publishes an event while an earlier unpublished
//! one of the same subject exists, and the inbox runtime handles one subject's
//! deliveries one at a time, in stream order. A subscription's events are
//! written one after the other (created, then cancelled), so created_at order
//! is their commit order and consumers see `subscription.created` before
//! `subscription.cancelled`. Different subscriptions, even of one customer,
//! are independent and flow in parallel: nothing billing does depends on the
//! order of two subscriptions.
//!
//! `subscription.trial_ended` is a **scheduled** event
//! ([`outbox_pg::Outbox::schedule`]): written with its subscription, due at
//! the trial's end, and cancelled if the subscription converts to paid (or is
//! cancelled) first. It is in no order with the subscription's other events:
//! the relay publishes it when it falls due, whatever was published for the
//! subscription meanwhile.

use chrono::{DateTime, Utc};
use outbox_pg::{Envelope, Event, Result};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `source` of every event this service writes.
pub const SOURCE: &str = "subscriptions";
/// Event type written when a subscription is created.
pub const CREATED: &str = SubscriptionCreated::TYPE;
/// Event type written when a subscription is cancelled.
pub const CANCELLED: &str = SubscriptionCancelled::TYPE;
/// Event type scheduled for a trial's end when a subscription with a trial is created.
pub const TRIAL_ENDED: &str = SubscriptionTrialEnded::TYPE;

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

/// `data` of `subscription.trial_ended` (kept as
/// `schemas/events/subscription.trial_ended.schema.json` too).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(
    description = "A subscription's trial ran out before it was converted to paid: it is charged from then on."
)]
pub struct SubscriptionTrialEnded {
    /// The subscription; also the envelope subject.
    #[schemars(length(min = 1))]
    pub subscription_id: String,
    /// Its customer.
    #[schemars(length(min = 1))]
    pub customer_id: String,
    /// When the trial ended (RFC 3339): the event's due time.
    #[schemars(with = "String", extend("format" = "date-time"))]
    pub trial_ended_at: DateTime<Utc>,
}

impl Event for SubscriptionTrialEnded {
    const TYPE: &'static str = "subscription.trial_ended";
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

/// The `subscription.trial_ended` envelope for `data`, with the subscription
/// as subject, the event id `id` (stored with the subscription, so that a
/// conversion can cancel it) and the trial's end as its `time`.
///
/// # Errors
/// As [`created`].
pub fn trial_ended(
    id: outbox_pg::EventId,
    data: SubscriptionTrialEnded,
) -> Result<Envelope<SubscriptionTrialEnded>> {
    let subject = data.subscription_id.clone();
    let ended = data.trial_ended_at;
    Ok(Envelope::event(SOURCE, subject, data)?
        .with_id(id)
        .with_time(ended))
}
