//! `GET /v1/subscriptions/{id}`.

use axum::Json;
use axum::extract::{Path, State};
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::error::ApiError;
use crate::state::AppState;

const GET: &str = include_str!("../../queries/get_subscription.sql");

/// A row of `subscriptions`, as `GET` answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Subscription {
    /// The id (`sub_…`).
    pub id: String,
    /// The customer.
    pub customer_id: String,
    /// The plan.
    pub plan: String,
    /// The price in cents.
    pub amount_cents: i64,
    /// `active` or `cancelled`.
    pub status: String,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When its trial ends (or ended); none without a trial.
    pub trial_ends_at: Option<DateTime<Utc>>,
    /// The id of its scheduled `subscription.trial_ended`; none without a trial.
    pub trial_event_id: Option<uuid::Uuid>,
    /// When its trial was converted to paid; none if it was not.
    pub converted_at: Option<DateTime<Utc>>,
}

pub(crate) async fn get(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Subscription>, ApiError> {
    sqlx::query_as::<_, Subscription>(GET)
        .bind(&id)
        .fetch_optional(&state.pool)
        .await?
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("subscription `{id}` not found")))
}
