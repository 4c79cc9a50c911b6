//! What a build needs from the node: sandboxes. Build steps are untrusted code, so they
//! run in ordinary sandboxes — same isolation, limits and egress rules as any other —
//! created over the layers built so far; after a step the sandbox is stopped and its
//! writable layer becomes the step's layer. The node implements [`BuildHost`]; the
//! template crate stays below it and never starts a process itself.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;

use crate::error::Result;

/// A build sandbox to start.
#[derive(Debug, Clone)]
pub struct BuildSandbox {
    /// Its read-only layers, bottom first.
    pub lowers: Vec<PathBuf>,
    /// Host files bind-mounted read-only (host path, path inside).
    pub binds: Vec<(PathBuf, PathBuf)>,
    /// vCPUs.
    pub cpus: u32,
    /// Memory in MiB.
    pub memory_mb: u64,
    /// Writable-layer quota in MiB.
    pub disk_mb: u64,
    /// Environment of its processes.
    pub env: BTreeMap<String, String>,
}

/// A process to run in a build sandbox.
#[derive(Debug, Clone)]
pub struct Exec {
    /// Program (absolute path inside the sandbox).
    pub cmd: String,
    /// Arguments.
    pub args: Vec<String>,
    /// User to run as.
    pub user: String,
    /// Working directory.
    pub cwd: Option<String>,
    /// Extra environment.
    pub env: BTreeMap<String, String>,
}

/// How a build's process ended.
#[derive(Debug, Clone)]
pub struct ExecEnd {
    /// Exit code (`-1`: killed by a signal).
    pub exit_code: i32,
    /// How envd describes the end (`exit status 1`, `signal: killed`).
    pub status: String,
}

/// The node, as builds use it.
pub trait BuildHost: Send + Sync {
    /// Start a sandbox; returns its id.
    fn start(&self, sb: BuildSandbox) -> impl Future<Output = Result<String>> + Send;
    /// Run a process to its end, handing each output line (`true` = stderr) to `line`.
    fn exec(
        &self,
        id: &str,
        exec: Exec,
        line: &(dyn Fn(bool, &str) + Send + Sync),
    ) -> impl Future<Output = Result<ExecEnd>> + Send;
    /// Start a process and leave it running (a template's start command).
    fn spawn(&self, id: &str, exec: Exec) -> impl Future<Output = Result<()>> + Send;
    /// Stop the sandbox and copy its writable layer into the empty directory `dest` as a
    /// layer (see `commit.rs`); then remove the sandbox.
    fn commit(&self, id: &str, dest: PathBuf) -> impl Future<Output = Result<()>> + Send;
    /// Kill and remove the sandbox.
    fn discard(&self, id: &str) -> impl Future<Output = ()> + Send;
}
