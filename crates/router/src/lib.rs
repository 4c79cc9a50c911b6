//! cubicle-router: the data plane. Every request that carries `E2b-Sandbox-Id` /
//! `E2b-Sandbox-Port` (or a `Host: <port>-<id>.<domain>`, or a presigned `/files` URL
//! opened without headers) is streamed to that port inside that sandbox. [`server`] is
//! the listener `cubicle serve` runs both planes on, with per-client connection limits
//! and a header-read timeout.

#![forbid(unsafe_code)]

use std::{os::fd::OwnedFd, path::PathBuf, sync::Arc};

/// Where a sandbox can be reached, as the control plane knows it.
#[derive(Debug, Clone)]
pub struct SandboxTarget {
    /// The sandbox id (`^[a-z0-9]+$`).
    pub id: String,
    /// envd's Unix socket on the host (`<state>/sandboxes/<id>/ctl/envd.sock`); reach it
    /// with `cubicle_runtime::connect_ctl_socket` (refuses symlinks the sandbox may plant).
    pub envd_socket: PathBuf,
    /// A pidfd of the sandbox's PID 1: user ports are reached by entering that process's
    /// network namespace through it (`setns` on a pidfd; it fails once the process has
    /// exited, so a reused pid never leads into another process's namespace). `None`:
    /// only envd's port is reachable.
    pub init_pidfd: Option<Arc<OwnedFd>>,
    /// The envd access token (also the secret of presigned file URLs).
    pub envd_access_token: Option<String>,
    /// Required as `e2b-traffic-access-token` on non-envd ports when set.
    pub traffic_access_token: Option<String>,
    /// `Host` sent to the sandbox's non-envd ports (E2B `maskRequestHost`; `${PORT}` is
    /// replaced by the port). `None`: the client's `Host` goes through.
    pub mask_request_host: Option<String>,
}

/// How the router finds sandboxes. Implemented by `cubicle serve` over the node and store.
pub trait SandboxResolver: Send + Sync + 'static {
    /// A running sandbox by id; `None` when unknown, killed or not running.
    fn resolve(&self, id: &str) -> Option<SandboxTarget>;
    /// All running sandboxes (to match presigned `/files` URLs opened without routing
    /// headers against each sandbox's token).
    fn running(&self) -> Vec<SandboxTarget>;
    /// A paused sandbox that a request may resume (auto-resume on): its tokens, to check
    /// the request against before anything is resumed (`init_pid` is 0). `None`
    /// otherwise.
    fn resumable(&self, id: &str) -> Option<SandboxTarget> {
        let _ = id;
        None
    }
    /// Resumes a [`resumable`](Self::resumable) sandbox; the running target, or `None`
    /// when that failed (the request then finds no sandbox).
    fn wake(&self, id: &str) -> WakeFuture {
        let _ = id;
        Box::pin(async { None })
    }
    /// A second look at a sandbox [`resolve`](Self::resolve) did not find running, for a
    /// resolver whose memory may lag behind the sandbox (an API replica of a cluster,
    /// which learns of a create, resume or fork through another replica at its next
    /// poll): the running target after asking the sandbox's owner, or `None`. Called only
    /// on that path: requests to running sandboxes stay in memory.
    fn recheck(&self, id: &str) -> WakeFuture {
        let _ = id;
        Box::pin(async { None })
    }
    /// An open, idle connection to sandbox `id`'s envd that the node made while creating
    /// it, for the connector to use instead of opening one (`None`: open one).
    fn take_envd_conn(&self, id: &str) -> Option<std::os::unix::net::UnixStream> {
        let _ = id;
        None
    }
}

/// What [`SandboxResolver::wake`] returns.
pub type WakeFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Option<SandboxTarget>> + Send>>;

/// Shared handle type.
pub type Resolver = Arc<dyn SandboxResolver>;

// ---- Additions by the router implementation (additive; the items above are the agreed
// interface with the resolver's implementer and are unchanged). ----

mod connector;
mod dataplane;
mod drain;
mod error;
mod presign;
mod relay;
mod routing;
pub mod server;
mod tunnel;

pub use dataplane::{Admitted, DataPlane};
pub use error::{RouterError, error_chain};
pub use relay::{NODE_TOKEN_HEADER, NodeConnector, NodeTls, Relay, node_connector};
pub use routing::ENVD_PORT;
pub use server::{ClientAddr, ServerLimits};

use std::time::Duration;

/// How the data plane behaves. Build it with `RouterConfig { domain: …, ..Default::default() }`.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Serve `Host: <port>-<id>.<domain>` (e.g. `8000-abc123.sandbox.example.com`) when set.
    /// Without it only the `E2b-Sandbox-*` headers (and presigned `/files` URLs) route.
    pub domain: Option<String>,
    /// Limit on opening a connection to a sandbox port (envd socket or TCP in its netns).
    pub connect_timeout: Duration,
    /// Idle upstream connections are kept this long for reuse.
    pub pool_idle_timeout: Duration,
    /// At most this many idle upstream connections per (sandbox, port).
    pub pool_max_idle_per_port: usize,
    /// An upgraded connection (WebSocket) to a user port is closed after this long
    /// without a byte in either direction.
    pub tunnel_idle_timeout: Duration,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            domain: None,
            connect_timeout: Duration::from_secs(5),
            pool_idle_timeout: Duration::from_secs(30),
            pool_max_idle_per_port: 16,
            tunnel_idle_timeout: Duration::from_secs(600),
        }
    }
}
