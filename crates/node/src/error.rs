//! The node crate's single error type.

use std::path::PathBuf;

/// Everything that can go wrong on a node.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A filesystem or syscall operation failed on a known path.
    #[error("{op} {path}: {source}")]
    Io {
        /// What we were doing.
        op: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The template store or a template build failed.
    #[error(transparent)]
    Template(#[from] cubicle_template::Error),
    /// A sandbox id that is not known to this node.
    #[error("sandbox '{0}' not found")]
    SandboxNotFound(String),
    /// A volume id that is not on this node (or is being deleted).
    #[error("volume '{0}' not found")]
    VolumeNotFound(String),
    /// A volume that live sandboxes mount (or that is being deleted) cannot be deleted.
    #[error("volume '{volume}' is in use{}; kill them (or wait for the deletion under way) first", in_use_by(.sandboxes))]
    VolumeInUse {
        /// The volume.
        volume: String,
        /// The sandboxes that mount it (empty: another deletion of it is under way).
        sandboxes: Vec<String>,
    },
    /// The request is invalid (bad id, bad limits, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The sandbox is not in a state that allows the operation (e.g. not running,
    /// already paused, paused and asked to fork, being paused).
    #[error("{0}")]
    Conflict(String),
    /// No free uid range / slot left.
    #[error("no capacity left: {0}")]
    Capacity(String),
    /// The isolation layer (`cubicle-runtime`) failed at step `what`.
    #[error("runtime: {what}: {source}")]
    Isolation {
        /// The step (e.g. `spawn`, `network attach`).
        what: String,
        /// The runtime's error.
        #[source]
        source: cubicle_runtime::Error,
    },
    /// Starting or running a sandbox failed outside the isolation layer: a readiness
    /// probe, a start command, a kill during creation, a task that panicked.
    #[error("runtime: {0}")]
    Runtime(String),
    /// envd inside the sandbox misbehaved or was unreachable.
    #[error("envd: {0}")]
    Envd(String),
    /// Another process uses the state directory (one node per state directory).
    #[error("{0}")]
    StateDirBusy(String),
    /// The slot range overlaps another node's on this host.
    #[error("{0}")]
    SlotsTaken(String),
    /// Checkpoint or restore failed at step `what` (the sandbox's state before the
    /// step is intact: a failed pause leaves it running, a failed resume paused).
    #[error("{what}: {source}")]
    Checkpoint {
        /// What was being done (e.g. `pausing sandbox x`).
        what: String,
        /// The checkpoint layer's error.
        #[source]
        source: cubicle_checkpoint::Error,
    },
    /// This node cannot do it (e.g. no CRIU installed); the message says what to do.
    #[error("{0}")]
    Unsupported(String),
    /// The object store failed (or holds a damaged blob: nothing was installed).
    #[error(transparent)]
    ObjectStore(#[from] cubicle_objstore::Error),
    /// What was asked for is neither on this node nor in the object store.
    #[error("{0}")]
    NotPublished(String),
    /// A snapshot that does not exist.
    #[error("snapshot '{0}' not found")]
    SnapshotNotFound(String),
    /// The sandbox's disk filled up (a node's answer to a replica: the message says
    /// where; on the node itself it is the `Io` or `Checkpoint` error that says so).
    #[error("{0}")]
    DiskFull(String),
    /// A JSON record could not be read or written.
    #[error("record {path}: {source}")]
    Record {
        /// The record file.
        path: PathBuf,
        /// The decode error.
        #[source]
        source: serde_json::Error,
    },
}

fn in_use_by(sandboxes: &[String]) -> String {
    match sandboxes {
        [] => " (being deleted)".into(),
        s => format!(" by sandbox(es) {}", s.join(", ")),
    }
}

/// Result alias for the node crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for an [`Error::Io`].
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Attach an operation and a path to an `io::Result`.
pub(crate) trait IoContext<T> {
    fn ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx(self, op: &'static str, path: impl Into<PathBuf>) -> Result<T> {
        self.map_err(|e| Error::io(op, path, e))
    }
}
