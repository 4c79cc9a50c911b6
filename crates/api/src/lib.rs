//! cubicle-api: the E2B-compatible REST control plane.
//!
//! Layout, in the order a request travels:
//! - [`routes`]: the HTTP layer (axum): auth by `X-API-KEY`, raw body/query in, JSON out;
//! - [`commands`] / [`query`] / [`templates`]: requests parsed into typed, validated
//!   commands (`CreateSandbox`, `SetTimeout`, `Connect`, `Refresh`, list filters);
//! - [`service`]: [`ControlPlane`], which executes them against the node
//!   ([`backend::Backend`]) and the store, with team isolation;
//! - [`error`]: the one error type and the one mapping to `{"code","message"}` bodies;
//! - [`resolver`]: the router's [`cubicle_router::SandboxResolver`] over the same state;
//! - [`volumes`] (`/volumes`), [`volume_content`] (`/volumecontent`, its own auth and
//!   error shape), [`secrets`] (`/secrets`, write-only values), [`keyring`] (the server's
//!   key: volume tokens, sealed secret values).
//! - [`operator`]: Cubicle's own routes for operators (API keys, the view across teams);
//! - [`dashboard`]: the web dashboard's static files (`/dashboard/`), which use the API
//!   above and the data plane with the visitor's API key.
//!
//! ```no_run
//! # async fn demo(node: cubicle_node::Node, store: cubicle_store::Store) {
//! use std::sync::Arc;
//! let config = cubicle_api::ApiConfig::new("/var/lib/cubicle/logs".into());
//! let cp = cubicle_api::ControlPlane::open(Arc::new(node), store, config).await.unwrap();
//! let app: axum::Router = cubicle_api::router(cp.clone());
//! let resolver = cubicle_api::ApiResolver::new(cp);
//! # let _ = (app, resolver); }
//! ```

#![forbid(unsafe_code)]

pub mod backend;
pub mod cluster;
pub mod commands;
pub mod dashboard;
pub mod error;
pub mod events;
pub mod key_cache;
pub mod keyring;
pub mod logs;
pub mod metrics;
pub mod model;
pub mod openapi;
pub mod operator;
pub mod query;
pub mod resolver;
pub mod routes;
pub mod secrets;
pub mod service;
pub mod telemetry;
pub mod template_builds;
pub mod templates;
pub mod tls;
pub mod volume_content;
pub mod volumes;
pub mod webhooks;

/// The operator's team: created by the first `cubicle serve` with the admin key; the only
/// team that may read the node-wide metrics (`GET /metrics`).
pub const ADMIN_TEAM: &str = "admin";

pub use backend::Backend;
pub use error::{ApiError, ApiResult};
pub use resolver::ApiResolver;
pub use routes::router;
pub use service::{ApiConfig, ControlPlane};

#[cfg(test)]
mod tests;
