//! The crate's one error type.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong while checkpointing or restoring a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// CRIU is not where Cubicle looks for it.
    #[error(
        "CRIU is not installed at {0} (run scripts/install-criu.sh, or set CUBICLE_CRIU to a criu 4.2+ binary)"
    )]
    NotInstalled(PathBuf),
    /// A host-side system call or file operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The isolation layer failed (cgroup, mounts, uid range).
    #[error(transparent)]
    Runtime(#[from] cubicle_runtime::Error),
    /// CRIU refused or failed; `log` holds the last lines of its log.
    #[error("criu {action} failed: {message}{log}")]
    Criu {
        /// `dump` or `restore`.
        action: &'static str,
        /// CRIU's own message, or how it ended.
        message: String,
        /// The end of CRIU's log (with a leading newline), empty if none.
        log: String,
    },
    /// The checkpoint's files are missing, damaged or from another format.
    #[error("checkpoint {dir}: {message}")]
    Image {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A process of the sandbox stayed inside vfork() — its child neither exec'd nor
    /// exited — for as long as the dump waited: CRIU cannot checkpoint it (it would stop
    /// the child before its exec and then wait for the parent for good). The sandbox runs
    /// on; a later try may succeed.
    #[error(
        "sandbox {id} cannot be checkpointed now: its thread(s) {tids:?} stayed inside vfork() for {waited:?} (a child that neither exec'd nor exited); it runs on"
    )]
    InVfork {
        /// The sandbox.
        id: String,
        /// Host thread ids waiting in vfork().
        tids: Vec<i32>,
        /// How long the dump waited for them.
        waited: std::time::Duration,
    },
    /// The disk (the sandbox's quota or the filesystem) filled up while writing the
    /// checkpoint; nothing was kept and the sandbox still runs.
    #[error(
        "not enough disk space for the checkpoint of sandbox {id} (its memory image counts against its disk quota): {detail}"
    )]
    NoSpace {
        /// The sandbox.
        id: String,
        /// Where it failed.
        detail: String,
    },
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// Whether the disk filling up caused this error.
    pub fn is_no_space(&self) -> bool {
        match self {
            Error::NoSpace { .. } => true,
            Error::Io { source, .. } => is_no_space_errno(source),
            _ => false,
        }
    }
}

pub(crate) fn is_no_space_errno(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}
