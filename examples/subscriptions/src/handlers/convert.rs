//! `POST /v1/subscriptions/{id}/convert`: a trial converted to paid, and its
//! scheduled `subscription.trial_ended` cancelled, in one transaction.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use outbox_pg::{Cancellation, EventId};
use serde::Serialize;

use crate::error::ApiError;
use crate::state::AppState;

const LOCK: &str = include_str!("../../queries/lock_trial.sql");
const CONVERT: &str = include_str!("../../queries/convert_subscription.sql");

/// The answer of a conversion: the subscription and the scheduled event that
/// will now never be published.
#[derive(Debug, Clone, Serialize)]
pub struct Converted {
    /// The subscription id.
    pub id: String,
    /// The id of the `subscription.trial_ended` cancelled in the same transaction.
    pub cancelled_event_id: String,
}

/// Converts a trial to paid. The subscription's row is locked first, so a
/// cancellation or a second conversion of it waits for this one. The
/// outbox's answer decides: the scheduled end cancelled, the conversion is
/// recorded with it; already published (the trial ran out, and billing hears
/// of it), nothing is written and the request answers `409`.
pub(crate) async fn convert(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Converted>, ApiError> {
    let mut tx = state.pool.begin().await?;
    let row: Option<(String, Option<uuid::Uuid>, Option<DateTime<Utc>>)> = sqlx::query_as(LOCK)
        .bind(&id)
        .fetch_optional(&mut *tx)
        .await?;
    let conflict = |why: &str| ApiError::Conflict(format!("subscription `{id}` {why}"));
    let trial = match row {
        None => return Err(ApiError::NotFound(format!("subscription `{id}` not found"))),
        Some((status, _, _)) if status != "active" => {
            return Err(conflict(&format!("is {status}")));
        }
        Some((_, None, _)) => return Err(conflict("has no trial")),
        Some((_, Some(_), Some(_))) => return Err(conflict("is already converted")),
        Some((_, Some(trial), None)) => EventId::from_uuid(trial),
    };
    match state.outbox.cancel(&mut tx, trial).await? {
        Cancellation::Cancelled => {}
        found => {
            // Published or on its way (or, long after, deleted by retention):
            // the trial has ended.
            tracing::debug!(subscription_id = %id, trial_event_id = %trial, ?found, "conversion too late");
            return Err(conflict("has already ended its trial"));
        }
    }
    sqlx::query(CONVERT).bind(&id).execute(&mut *tx).await?;
    if state.rollback_requested(&headers) {
        tx.rollback().await?;
        return Err(ApiError::InjectedRollback { id });
    }
    tx.commit().await?;
    tracing::info!(subscription_id = %id, trial_event_id = %trial, "trial converted to paid");
    Ok(Json(Converted {
        id,
        cancelled_event_id: trial.to_string(),
    }))
}
