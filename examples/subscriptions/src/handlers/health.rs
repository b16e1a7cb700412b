//! `GET /healthz`: the database answers `select 1`.

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::state::AppState;

const HEALTH: &str = include_str!("../../queries/health.sql");

pub(crate) async fn healthz(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    sqlx::query(HEALTH)
        .execute(&state.pool)
        .await
        .map_err(ApiError::Unavailable)?;
    Ok(Json(json!({"status": "ok"})))
}
