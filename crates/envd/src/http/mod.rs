//! envd's plain HTTP endpoints: `/health`, `/files`, `/init`, `/envs`, `/metrics`.

use std::sync::Arc;

use axum::{Router, http::StatusCode, routing::get};

use crate::server::AppState;

/// Routes of the HTTP endpoints.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/health", get(|| async { StatusCode::NO_CONTENT }))
}
