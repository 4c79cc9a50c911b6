//! The API's one error type and the one place where errors become HTTP responses:
//! `{"code": <status>, "message": "…"}` (the shape the E2B SDKs parse before anything
//! else), with `Should-Retry: false` on 5xx answers a retry would not fix.
//!
//! [`json_errors`] also rewrites any non-JSON error response (axum's own rejections for
//! bad paths, 405s, …) into that shape, so no route can answer plain text.

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Malformed or invalid input.
    #[error("{0}")]
    BadRequest(String),
    /// Missing or unknown API key.
    #[error("{0}")]
    Unauthorized(String),
    /// A valid key that may not do this (a non-admin team reading `/metrics`, another
    /// team's template name).
    #[error("{0}")]
    Forbidden(String),
    /// Unknown (or other team's) sandbox, template or route.
    #[error("{0}")]
    NotFound(String),
    /// Wrong method on a known route.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// Conflicts with the current state (idempotency key reuse, …).
    #[error("{0}")]
    Conflict(String),
    /// Body over the limit.
    #[error("request body is larger than {0} bytes")]
    PayloadTooLarge(usize),
    /// A feature Cubicle does not have yet (pause, resume, snapshots, …).
    #[error("{0}")]
    NotImplemented(String),
    /// Out of capacity: a retry later may succeed.
    #[error("{0}")]
    Unavailable(String),
    /// The disk (quota) is full: e.g. a pause whose checkpoint does not fit.
    #[error("{0}")]
    InsufficientStorage(String),
    /// A resume with memory of a sandbox paused while its envd did not answer (409 with
    /// E2B's `error_code`).
    #[error("{0}")]
    GuestUnresponsive(String),
    /// Our fault.
    #[error("{0}")]
    Internal(String),
}

/// Result alias.
pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    /// HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::InsufficientStorage(_) => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::GuestUnresponsive(_) => StatusCode::CONFLICT,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Shorthand for a 404 about a sandbox.
    pub fn sandbox_not_found(id: &str) -> Self {
        ApiError::NotFound(format!("sandbox '{id}' not found"))
    }
}

/// The E2B error body (every error answer has it).
#[derive(Debug, serde::Serialize, utoipa::ToSchema, utoipa::ToResponse)]
#[response(description = "An error: the HTTP status and what went wrong")]
pub struct ErrorBody {
    /// The HTTP status.
    pub code: u16,
    /// What went wrong (and what to do).
    pub message: String,
}

/// The E2B error body as a response.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    let body = ErrorBody {
        code: status.as_u16(),
        message: message.to_string(),
    };
    let mut resp = (status, axum::Json(body)).into_response();
    // Python retries 502/503/504 unless told otherwise; only capacity errors (503) are
    // worth retrying here.
    if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
        resp.headers_mut()
            .insert("should-retry", HeaderValue::from_static("false"));
    }
    resp
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() && status != StatusCode::NOT_IMPLEMENTED {
            tracing::error!("request failed: {self}");
        }
        if let ApiError::GuestUnresponsive(m) = &self {
            let body = serde_json::json!({
                "code": status.as_u16(),
                "message": m,
                "error_code": "sandbox_snapshot_guest_agent_unresponsive",
            });
            return (status, axum::Json(body)).into_response();
        }
        error_response(status, &self.to_string())
    }
}

impl From<cubicle_node::Error> for ApiError {
    fn from(e: cubicle_node::Error) -> Self {
        use cubicle_node::Error as N;
        match e {
            N::Template(cubicle_node::template::Error::TemplateNotFound(name)) => {
                ApiError::NotFound(format!("template '{name}' not found"))
            }
            N::Template(cubicle_node::template::Error::InvalidRequest(m)) => {
                ApiError::BadRequest(m)
            }
            N::SandboxNotFound(id) => ApiError::sandbox_not_found(&id),
            N::VolumeNotFound(id) => ApiError::NotFound(format!("volume '{id}' not found")),
            e @ N::VolumeInUse { .. } => ApiError::Conflict(e.to_string()),
            N::InvalidRequest(m) => ApiError::BadRequest(m),
            N::Capacity(m) => ApiError::Unavailable(m),
            N::Conflict(m) => ApiError::Conflict(m),
            N::Unsupported(m) => ApiError::NotImplemented(m),
            N::SnapshotNotFound(name) => ApiError::NotFound(format!("snapshot '{name}' not found")),
            e => match disk_full(&e) {
                Some(m) => ApiError::InsufficientStorage(m),
                None => ApiError::Internal(e.to_string()),
            },
        }
    }
}

/// What to say when node error `e` means the sandbox's disk is full (507), or `None`.
/// Also what a node tells a replica (`cluster::WireError`), so that both answer alike.
pub(crate) fn disk_full(e: &cubicle_node::Error) -> Option<String> {
    use cubicle_node::Error as N;
    match e {
        N::Checkpoint { what, source } if source.is_no_space() => Some(format!("{what}: {source}")),
        // The node's own files, or those written through the template crate's helpers
        // (`sandbox.json`, checkpoint records).
        N::Io { op, path, source }
        | N::Template(cubicle_node::template::Error::Io { op, path, source })
            if matches!(
                source.kind(),
                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
            ) =>
        {
            Some(format!(
                "{op} {}: {source} (the sandbox's disk is full)",
                path.display()
            ))
        }
        N::DiskFull(m) => Some(m.clone()),
        _ => None,
    }
}

impl From<cubicle_store::Error> for ApiError {
    fn from(e: cubicle_store::Error) -> Self {
        use cubicle_store::Error as S;
        match e {
            S::NotFound(m) => ApiError::NotFound(m),
            S::Conflict(m) => ApiError::Conflict(m),
            S::Invalid(m) => ApiError::BadRequest(m),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

/// Middleware body: turn any error response that is not already JSON into the E2B error
/// shape (keeps the status; the original text becomes the message).
pub async fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    if status.as_u16() < 400 {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = match axum::body::to_bytes(body, 16 * 1024).await {
        Ok(b) if !b.is_empty() => String::from_utf8_lossy(&b).trim().to_string(),
        _ => status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_lowercase(),
    };
    let mut out = error_response(status, &text);
    for (k, v) in parts.headers.iter() {
        if k != header::CONTENT_TYPE && k != header::CONTENT_LENGTH {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    // The route label and the like travel on (the access log reads them).
    *out.extensions_mut() = parts.extensions;
    out
}

/// A 404 for routes that do not exist.
pub async fn unknown_route(uri: axum::http::Uri) -> Response {
    ApiError::NotFound(format!("no such route: {}", uri.path())).into_response()
}

/// Read a whole request body, refusing more than `limit` bytes.
pub async fn read_body(body: Body, limit: usize) -> ApiResult<bytes::Bytes> {
    use http_body_util::BodyExt;
    let limited = http_body_util::Limited::new(body, limit);
    match limited.collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::PayloadTooLarge(limit))
        }
        Err(e) => Err(ApiError::BadRequest(format!(
            "cannot read request body: {e}"
        ))),
    }
}
