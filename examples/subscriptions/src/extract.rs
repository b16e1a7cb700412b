//! [`ApiJson`]: axum's `Json` extractor with every rejection answered as `422`.

use axum::Json;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON request body. axum answers a wrong content type with `415`, bad
/// syntax with `400` and a body of the wrong shape with `422`, each in plain
/// text; this extractor answers all of them `422` with a JSON body whose
/// message names the failing field (axum reports the path of a data error).
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiJson<T>(pub T);

impl<T, S> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError::Invalid(message(&rejection))),
        }
    }
}

fn message(rejection: &JsonRejection) -> String {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => {
            "the body must be JSON, sent with `content-type: application/json`".to_owned()
        }
        other => other.body_text(),
    }
}
