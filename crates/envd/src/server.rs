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

/// Takes ownership of the listening Unix socket inherited as descriptor `fd` (checked to
/// be one), close-on-exec and non-blocking from now on.
pub fn inherited_unix_listener(fd: i32) -> std::io::Result<std::os::unix::net::UnixListener> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: fcntl/fstat on a descriptor number; errors if it is not open.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is not a socket"),
        ));
    }
    // SAFETY: the descriptor was passed to this process to own (command line contract).
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fcntl with integer arguments on our descriptor.
    if unsafe { libc::fcntl(owned.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let listener = std::os::unix::net::UnixListener::from(owned);
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Serves on an inherited listening Unix socket until the process ends.
pub async fn serve_unix_listener(
    state: Arc<AppState>,
    listener: std::os::unix::net::UnixListener,
) -> std::io::Result<()> {
    let listener = tokio::net::UnixListener::from_std(listener)?;
    tracing::info!(addr = ?listener.local_addr().ok(), "envd listening (inherited socket)");
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
