//! `POST /v1/subscriptions/{id}/cancel`: the status change and
//! `subscription.cancelled` in one transaction.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::HeaderMap;

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
    let customer_id: Option<String> = sqlx::query_scalar(CANCEL)
        .bind(&id)
        .fetch_optional(&mut *tx)
        .await?;
    let Some(customer_id) = customer_id else {
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
    if state.rollback_requested(&headers) {
        tx.rollback().await?;
        return Err(ApiError::InjectedRollback { id });
    }
    tx.commit().await?;
    tracing::info!(subscription_id = %id, %event_id, %customer_id, "subscription cancelled");
    Ok(Json(Written {
        id,
        event_id: event_id.to_string(),
    }))
}
