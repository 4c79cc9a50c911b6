//! The HTTP server: one axum router with the Connect services (`/process.Process/*`,
//! `/filesystem.Filesystem/*`) and the plain HTTP endpoints (`/health`, `/files`,
//! `/init`, `/envs`, `/metrics`), behind the access-token check.

use std::{path::Path, sync::Arc};

use axum::{Router, middleware};

use crate::{auth, filesystem, http, process, state::Context};

/// Everything a request handler may need.
pub struct AppState {
    pub ctx: Arc<Context>,
    pub process: process::ProcessService,
    pub filesystem: filesystem::FilesystemService,
}

impl AppState {
    pub fn new(ctx: Arc<Context>) -> Arc<Self> {
        Arc::new(Self {
            process: process::ProcessService::new(ctx.clone()),
            filesystem: filesystem::FilesystemService::new(ctx.clone()),
            ctx,
        })
    }
}

/// The complete router.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .merge(process::routes())
        .merge(filesystem::routes())
        .merge(http::routes())
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ))
        .with_state(state)
}

/// Serves on a TCP address until the process ends.
pub async fn serve_tcp(state: Arc<AppState>, addr: std::net::SocketAddr) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    // TCP_NODELAY: stream messages are small writes; with Nagle the second one waits for
    // the client's delayed ACK (~40 ms per `commands.run`).
    let listener = tokio::net::TcpListener::bind(addr).await?.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tracing::info!(%addr, "envd listening");
    axum::serve(listener, router(state)).await
}

/// Serves on a Unix socket (the node's way in) until the process ends.
pub async fn serve_unix(state: Arc<AppState>, path: &Path) -> std::io::Result<()> {
    let _ = std::fs::remove_file(path);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    tracing::info!(path = %path.display(), "envd listening");
    axum::serve(listener, router(state)).await
}
