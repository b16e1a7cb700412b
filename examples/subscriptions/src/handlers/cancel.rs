//! `POST /v1/subscriptions/{id}/cancel`: the status change and
//! `subscription.cancelled` in one transaction, and the cancellation of the
//! trial's scheduled end if it has not been published yet.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use outbox_pg::{Cancellation, EventId};

use super::Written;
use crate::error::ApiError;
use crate::events::{self, SubscriptionCancelled};
use crate::state::AppState;

const CANCEL: &str = include_str!("../../queries/cancel_subscription.sql");
const STATUS: &str = include_str!("../../queries/subscription_status.sql");

pub(crate) async fn cancel(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Written>, ApiError> {
    let mut tx = state.pool.begin().await?;
    // The conditional update takes the row lock: of two concurrent cancels,
    // the second waits, finds the row cancelled and answers 409.
    let cancelled: Option<(String, Option<uuid::Uuid>, Option<DateTime<Utc>>)> =
        sqlx::query_as(CANCEL)
            .bind(&id)
            .fetch_optional(&mut *tx)
            .await?;
    let Some((customer_id, trial_event_id, converted_at)) = cancelled else {
        let status: Option<String> = sqlx::query_scalar(STATUS)
            .bind(&id)
            .fetch_optional(&mut *tx)
            .await?;
        return Err(match status {
            None => ApiError::NotFound(format!("subscription `{id}` not found")),
            Some(status) => ApiError::Conflict(format!("subscription `{id}` is already {status}")),
        });
    };
    let event = events::cancelled(SubscriptionCancelled {
        subscription_id: id.clone(),
        customer_id: customer_id.clone(),
    })?;
    let event_id = state.outbox.enqueue(&mut tx, &event).await?;
    // A subscription cancelled in its trial never reaches the trial's end:
    // its scheduled event is cancelled with it, unless already published.
    if let (Some(trial), None) = (trial_event_id, converted_at) {
        let trial = EventId::from_uuid(trial);
        let found = state.outbox.cancel(&mut tx, trial).await?;
        tracing::debug!(subscription_id = %id, trial_event_id = %trial, cancelled = found == Cancellation::Cancelled, "trial end cancelled with the subscription");
    }
    if state.rollback_requested(&headers) {
        tx.rollback().await?;
        return Err(ApiError::InjectedRollback { id });
    }
    tx.commit().await?;
    tracing::info!(subscription_id = %id, %event_id, %customer_id, "subscription cancelled");
    Ok(Json(Written::new(id, event_id)))
}
