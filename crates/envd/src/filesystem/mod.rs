//! `filesystem.Filesystem`: stat, list, make, move, remove, and watch directories.

use std::sync::Arc;

use axum::Router;

use crate::{server::AppState, state::Context};

/// Filesystem RPCs and the table of polling watchers.
pub struct FilesystemService {
    #[allow(dead_code)]
    ctx: Arc<Context>,
}

impl FilesystemService {
    pub fn new(ctx: Arc<Context>) -> Self {
        Self { ctx }
    }
}

/// Routes of `filesystem.Filesystem`.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
}
