//! `POST /v1/subscriptions`: the row and `subscription.created` in one
//! transaction, and with a trial its scheduled `subscription.trial_ended`.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use outbox_pg::{Due, EventId};
use serde::Deserialize;

use super::Written;
use crate::error::ApiError;
use crate::events::{self, SubscriptionCreated, SubscriptionTrialEnded};
use crate::extract::ApiJson;
use crate::state::AppState;

const INSERT: &str = include_str!("../../queries/insert_subscription.sql");

/// The request body. Unknown fields are refused.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewSubscription {
    /// Who subscribes; must not be blank.
    pub customer_id: String,
    /// The plan; must not be blank.
    pub plan: String,
    /// The price in cents; must not be negative.
    pub amount_cents: i64,
    /// Whether the subscription starts with a trial (of the service's trial
    /// period). Default: no trial.
    #[serde(default)]
    pub trial: bool,
}

impl NewSubscription {
    fn validate(&self) -> Result<(), ApiError> {
        if self.customer_id.trim().is_empty() {
            return Err(ApiError::Invalid("customer_id: must not be empty".into()));
        }
        if self.customer_id.chars().any(char::is_control) {
            return Err(ApiError::Invalid(
                "customer_id: must not contain control characters".into(),
            ));
        }
        if self.plan.trim().is_empty() {
            return Err(ApiError::Invalid("plan: must not be empty".into()));
        }
        if self.amount_cents < 0 {
            return Err(ApiError::Invalid(format!(
                "amount_cents: must not be negative (got {})",
                self.amount_cents
            )));
        }
        Ok(())
    }
}

/// A new subscription id: `sub_` and a UUID v7, so ids sort by creation.
pub fn new_subscription_id() -> String {
    format!("sub_{}", uuid::Uuid::now_v7().simple())
}

pub(crate) async fn create(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<NewSubscription>,
) -> Result<Response, ApiError> {
    body.validate()?;
    let id = new_subscription_id();
    let event = events::created(SubscriptionCreated {
        subscription_id: id.clone(),
        customer_id: body.customer_id.clone(),
        plan: body.plan.clone(),
        amount_cents: body.amount_cents,
    })?;
    let trial = body.trial.then(|| {
        let millis = state.trial_period.as_millis().max(1);
        (EventId::new(), i64::try_from(millis).unwrap_or(i64::MAX))
    });

    // Row, event and the trial's end in one transaction; any error drops
    // `tx`, which rolls back.
    let mut tx = state.pool.begin().await?;
    let trial_ends_at: Option<DateTime<Utc>> = sqlx::query_scalar(INSERT)
        .bind(&id)
        .bind(&body.customer_id)
        .bind(&body.plan)
        .bind(body.amount_cents)
        .bind(trial.map(|(_, millis)| millis))
        .bind(trial.map(|(event_id, _)| *event_id.as_uuid()))
        .fetch_one(&mut *tx)
        .await?;
    let event_id = state.outbox.enqueue(&mut tx, &event).await?;
    let mut written = Written::new(id.clone(), event_id);
    if let (Some((trial_event_id, _)), Some(ends)) = (trial, trial_ends_at) {
        let ended = events::trial_ended(
            trial_event_id,
            SubscriptionTrialEnded {
                subscription_id: id.clone(),
                customer_id: body.customer_id.clone(),
                trial_ended_at: ends,
            },
        )?;
        state
            .outbox
            .schedule(&mut tx, &ended, Due::At(ends))
            .await?;
        written.trial_event_id = Some(trial_event_id.to_string());
        written.trial_ends_at = Some(ends);
    }
    if state.rollback_requested(&headers) {
        tx.rollback().await?;
        return Err(ApiError::InjectedRollback { id });
    }
    tx.commit().await?;
    tracing::info!(subscription_id = %id, %event_id, customer_id = %body.customer_id, trial_ends_at = ?trial_ends_at, "subscription created");

    let location = HeaderValue::from_str(&format!("/v1/subscriptions/{id}")).ok();
    let written = Json(written);
    Ok(match location {
        Some(location) => {
            (StatusCode::CREATED, [(header::LOCATION, location)], written).into_response()
        }
        None => (StatusCode::CREATED, written).into_response(),
    })
}
