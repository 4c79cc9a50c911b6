//! The crate's one error type (isolation, storage and network alike).

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
    /// A sandbox id that does not follow the one rule ([`crate::SandboxId`]).
    #[error("invalid sandbox id {0:?} (1-32 characters of [a-z0-9])")]
    InvalidId(String),
    /// An external tool (`mount`, `mkfs.*`, `btrfs`) failed.
    #[error("{command} failed: {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// What it printed on stderr.
        stderr: String,
    },
    /// The host cannot enforce disk quotas where the storage lives.
    #[error("no disk quota support: {0}")]
    QuotaUnsupported(String),
    /// Every XFS project id is in use.
    #[error("no project ids left")]
    NoFreeProjectId,
    /// `nft` refused a ruleset.
    #[error("nft failed while {context}: {stderr}")]
    Nft {
        /// What the ruleset was for.
        context: String,
        /// What nft printed on stderr.
        stderr: String,
    },
    /// The network configuration is not usable; the message says which part.
    #[error("invalid network configuration: {0}")]
    NetworkConfig(String),
    /// Not an IPv4 network in CIDR notation.
    #[error("invalid IPv4 CIDR {0:?} (expected a.b.c.d or a.b.c.d/len; sandboxes are IPv4-only)")]
    InvalidCidr(String),
    /// A network slot beyond the address pool.
    #[error("slot {slot} is outside the address pool {pool} ({max} slots)")]
    SlotOutOfRange {
        /// The slot asked for.
        slot: u32,
        /// The pool.
        pool: crate::network::Ipv4Cidr,
        /// How many slots the pool has.
        max: u32,
    },
}

impl Error {
    /// An [`Error::Io`] saying what was being done.
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// Crate result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Adds context to an `io::Error`: `.map_err(io_err(format!("opening {}", p.display())))`.
pub(crate) fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

/// Like [`io_err`], with the context built only on failure:
/// `.map_err(io_ctx(|| format!("mkdir {}", p.display())))`.
pub(crate) fn io_ctx<F: FnOnce() -> String>(f: F) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io {
        context: f(),
        source,
    }
}
