//! `POST /v1/subscriptions`: the row and `subscription.created` in one transaction.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::Written;
use crate::error::ApiError;
use crate::events::{self, SubscriptionCreated};
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

    // Row and event in one transaction; any error drops `tx`, which rolls back.
    let mut tx = state.pool.begin().await?;
    sqlx::query(INSERT)
        .bind(&id)
        .bind(&body.customer_id)
        .bind(&body.plan)
        .bind(body.amount_cents)
        .execute(&mut *tx)
        .await?;
    let event_id = state.outbox.enqueue(&mut tx, &event).await?;
    if state.rollback_requested(&headers) {
        tx.rollback().await?;
        return Err(ApiError::InjectedRollback { id });
    }
    tx.commit().await?;
    tracing::info!(subscription_id = %id, %event_id, customer_id = %body.customer_id, "subscription created");

    let location = HeaderValue::from_str(&format!("/v1/subscriptions/{id}")).ok();
    let written = Json(Written {
        id,
        event_id: event_id.to_string(),
    });
    Ok(match location {
        Some(location) => {
            (StatusCode::CREATED, [(header::LOCATION, location)], written).into_response()
        }
        None => (StatusCode::CREATED, written).into_response(),
    })
}
