//! The crate's one error type.

use std::io;

/// Everything that can go wrong while creating, inspecting or destroying a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The [`SandboxSpec`](crate::SandboxSpec) is not acceptable; the message names the field.
    #[error("invalid sandbox spec: {0}")]
    InvalidSpec(String),
    /// A host-side system call or file operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// The helper or the sandbox child failed during setup; the message names the step
    /// (e.g. `overlay: mount ...: Invalid argument`).
    #[error("sandbox setup failed: {0}")]
    Setup(String),
    /// No usable cgroup hierarchy, or a cgroup file had unexpected content.
    #[error("cgroup: {0}")]
    Cgroup(String),
    /// The seccomp policy could not be compiled.
    #[error("seccomp policy: {0}")]
    Seccomp(String),
    /// No sandbox with this id exists on this host.
    #[error("sandbox {0} not found (no cgroup cubicle/{0} and no running init)")]
    NotFound(String),
}

/// Crate result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Adds context to an `io::Error`: `.map_err(io_ctx(|| format!("mkdir {}", p.display())))`.
pub(crate) fn io_ctx<F: FnOnce() -> String>(f: F) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io {
        context: f(),
        source,
    }
}
