//! Every API failure, and how it looks on the wire: OpenAI's error object with an HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use pipeshard_head::HeadError;
use serde_json::{json, Value};

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
    code: Option<&'static str>,
    /// Seconds for a `Retry-After` header.
    retry_after: Option<u32>,
}

impl ApiError {
    /// Any status.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }
    /// 400.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }
    /// A failure while generating: 503 when the ring is down, else 500.
    pub fn generation(message: String) -> Self {
        if message.starts_with("the ring is unavailable") {
            Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                message,
            )
        } else {
            Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
        }
    }
    /// Names the offending parameter.
    pub fn with_param(mut self, p: &'static str) -> Self {
        self.param = Some(p);
        self
    }
    /// A machine-readable code.
    pub fn with_code(mut self, c: &'static str) -> Self {
        self.code = Some(c);
        self
    }
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }
    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<HeadError> for ApiError {
    fn from(e: HeadError) -> Self {
        match e {
            HeadError::Invalid(m) => Self::bad_request(m),
            HeadError::Busy(m) => {
                let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", m);
                e.retry_after = Some(1);
                e
            }
            e @ (HeadError::Unavailable(_) | HeadError::Ring(_) | HeadError::Stopped) => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                e.to_string(),
            ),
            e @ HeadError::Stage(_) => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, "{}", self.message);
        }
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}
