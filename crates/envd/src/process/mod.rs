//! `process.Process`: start, attach to, feed, signal and list processes (and PTYs).

use std::sync::Arc;

use axum::Router;

use crate::{server::AppState, state::Context};

/// The process table and its RPCs.
pub struct ProcessService {
    #[allow(dead_code)]
    ctx: Arc<Context>,
}

impl ProcessService {
    pub fn new(ctx: Arc<Context>) -> Self {
        Self { ctx }
    }
}

/// Routes of `process.Process`.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
}
