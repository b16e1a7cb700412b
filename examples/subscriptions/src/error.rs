//! Errors: [`ApiError`], what a request answers when it fails, and [`Error`],
//! what start-up reports.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// A failed request. Every variant answers a JSON body `{"error": "…"}`, and
/// none leaves anything written: the transaction is rolled back first.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// The request body is not acceptable (malformed JSON, a missing, unknown
    /// or mistyped field, a blank id, a negative amount, a schema violation):
    /// `422`, the message naming the field or JSON pointer.
    #[error("{0}")]
    Invalid(String),
    /// No such subscription: `404`.
    #[error("{0}")]
    NotFound(String),
    /// The subscription is not in a state that allows the request: `409`.
    #[error("{0}")]
    Conflict(String),
    /// `--fault-injection` and `x-fault: rollback`: every write was done and
    /// then rolled back. `500`, with the id the subscription would have had.
    #[error("injected rollback")]
    InjectedRollback {
        /// The subscription id that was written and rolled back.
        id: String,
    },
    /// The database cannot be reached: `503`.
    #[error("database unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    /// Anything else: `500`, logged with its cause.
    #[error("internal error: {0}")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl ApiError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Invalid(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::InjectedRollback { .. } | Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::WorkerCrashed => Self::Unavailable(e),
            other => Self::Internal(Box::new(other)),
        }
    }
}

impl From<outbox_pg::Error> for ApiError {
    fn from(e: outbox_pg::Error) -> Self {
        use outbox_pg::ErrorKind as K;
        match e.kind() {
            K::SchemaViolation => {
                let event_type = e.event_type().unwrap_or("event");
                let details = e
                    .violations()
                    .iter()
                    .map(|v| {
                        let pointer = if v.instance_path.is_empty() {
                            "/"
                        } else {
                            v.instance_path.as_str()
                        };
                        format!("{pointer}: {}", v.message)
                    })
                    .collect::<Vec<_>>()
                    .join("; ");
                Self::Invalid(format!(
                    "{event_type} payload violates its schema: {details}"
                ))
            }
            // The type, source and subject (the generated id) are ours: an
            // invalid envelope is a bug, not bad input.
            K::InvalidEnvelope => Self::Internal(Box::new(e)),
            _ => Self::Internal(Box::new(e)),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = match &self {
            Self::InjectedRollback { id } => json!({"error": "injected rollback", "id": id}),
            Self::Internal(cause) => {
                tracing::error!(error = %cause, "request failed");
                json!({"error": "internal error"})
            }
            Self::Unavailable(cause) => {
                tracing::warn!(error = %cause, "database unavailable");
                json!({"error": self.to_string()})
            }
            other => json!({"error": other.to_string()}),
        };
        (status, Json(body)).into_response()
    }
}

/// A start-up failure: migrating the database.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The outbox migrations, or creating the `subscriptions` table, failed.
    #[error("migrating the subscriptions database: {0}")]
    Migrate(#[from] outbox_pg::Error),
}
