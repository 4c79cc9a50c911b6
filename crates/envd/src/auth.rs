//! Who may call envd, and as whom.
//!
//! * Access token: once set (by `/init` or `--access-token`), every route except
//!   `GET /health` and `/files` (which also accepts a URL signature) requires the header
//!   `X-Access-Token`; otherwise `401 {"code":401,"message":…}`.
//! * Acting user: `Authorization: Basic base64("<user>:")` selects the user of an RPC;
//!   absent, the sandbox's default user. Unknown users are `unauthenticated`.

use std::sync::Arc;

use axum::{
    extract::{Request, State},
    http::{HeaderMap, StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};
use base64::Engine;

use crate::{
    connect::ConnectError,
    server::AppState,
    state::Context,
    users::{self, User},
};

/// Header carrying the sandbox's access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";

/// A plain-HTTP JSON error in the shape envd's REST endpoints use: `{"code":N,"message":…}`.
pub fn http_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({ "code": status.as_u16(), "message": message.into() });
    let mut resp = (status, body.to_string()).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// Compares two byte strings in time independent of where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether the request carries the right token (or none is needed).
pub fn token_ok(ctx: &Context, headers: &HeaderMap) -> bool {
    match ctx.access_token() {
        None => true,
        Some(expected) => headers
            .get(ACCESS_TOKEN_HEADER)
            .map(|v| constant_time_eq(v.as_bytes(), expected.as_bytes()))
            .unwrap_or(false),
    }
}

/// Middleware: requires the access token on every route but `/health` and `/files`.
pub async fn require_token(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path();
    if path == "/health" || path == "/files" || token_ok(&state.ctx, req.headers()) {
        return next.run(req).await;
    }
    // Keep reading what the client is still sending (bounded) while the 401 goes out:
    // hyper closes a connection whose request body was left unread, and a client still
    // writing its (chunked) body would see a broken pipe instead of the 401.
    let body = req.into_body();
    tokio::spawn(async move {
        let limit = 1 << 20;
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            axum::body::to_bytes(body, limit),
        )
        .await;
    });
    http_error(StatusCode::UNAUTHORIZED, "invalid access token")
}

/// The user named by Basic auth, if any. Malformed headers are an error.
pub fn basic_auth_user(headers: &HeaderMap) -> Result<Option<String>, ConnectError> {
    let Some(value) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let text = value
        .to_str()
        .map_err(|_| ConnectError::unauthenticated("invalid authorization header"))?;
    let Some(encoded) = text
        .strip_prefix("Basic ")
        .or_else(|| text.strip_prefix("basic "))
    else {
        return Err(ConnectError::unauthenticated(
            "authorization must use the Basic scheme",
        ));
    };
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .map_err(|_| ConnectError::unauthenticated("invalid Basic authorization"))?;
    let decoded = String::from_utf8(decoded)
        .map_err(|_| ConnectError::unauthenticated("invalid Basic authorization"))?;
    let name = decoded.split(':').next().unwrap_or_default().to_string();
    Ok(if name.is_empty() { None } else { Some(name) })
}

/// Resolves a user name (or the default user when `None`).
pub fn resolve_user(ctx: &Context, name: Option<&str>) -> Result<User, ConnectError> {
    match name {
        Some(n) => users::by_name(n)
            .ok_or_else(|| ConnectError::unauthenticated(format!("invalid username: '{n}'"))),
        None => ctx
            .default_user()
            .ok_or_else(|| ConnectError::unauthenticated("the default user does not exist")),
    }
}

/// The acting user of an RPC: Basic auth, else the default user.
pub fn acting_user(ctx: &Context, headers: &HeaderMap) -> Result<User, ConnectError> {
    let name = basic_auth_user(headers)?;
    resolve_user(ctx, name.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_user() {
        let mut h = HeaderMap::new();
        assert_eq!(basic_auth_user(&h).unwrap(), None);
        h.insert(header::AUTHORIZATION, "Basic cm9vdDo=".parse().unwrap());
        assert_eq!(basic_auth_user(&h).unwrap().as_deref(), Some("root"));
        h.insert(header::AUTHORIZATION, "Bearer x".parse().unwrap());
        assert!(basic_auth_user(&h).is_err());
    }

    #[test]
    fn eq() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
