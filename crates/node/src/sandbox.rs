//! What a sandbox is to the node: the create request, the on-disk record
//! (`<state>/sandboxes/<id>/sandbox.json`, which makes reconciliation after a crash
//! possible), the public info, and why a sandbox died.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cubicle_runtime::SandboxId;
use serde::{Deserialize, Serialize};

pub use cubicle_egress::{NetEvent, NetworkPolicy};

/// Ask the node for a sandbox. `None` fields take the template's (or node's) default.
/// Serializable for the node-side API of a cluster (`cubicle node`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct CreateRequest {
    /// Template name (`tiny`, `base`, …).
    pub template: String,
    /// Sandbox id (`^[a-z0-9]+$`); a new one (`i` + 20 chars) when `None`.
    pub id: Option<String>,
    /// Environment for every process in the sandbox (passed to envd's `/init`).
    pub env_vars: BTreeMap<String, String>,
    /// Memory limit in MiB.
    pub memory_mb: Option<u64>,
    /// vCPU count (CPU share).
    pub cpus: Option<u32>,
    /// Writable-layer quota in MiB.
    pub disk_mb: Option<u64>,
    /// Internet access (veth + NAT) or loopback only.
    pub internet: bool,
    /// Egress policy (E2B `network` options; default: everything the node allows).
    pub network: NetworkPolicy,
    /// `Host` the data plane sends to the sandbox's ports (E2B `maskRequestHost`;
    /// `${PORT}` is replaced by the port).
    pub mask_request_host: Option<String>,
    /// Lifetime; the node kills the sandbox when it passes. `None`: node default (300 s).
    pub timeout: Option<Duration>,
    /// Opaque user metadata, stored and returned.
    pub metadata: BTreeMap<String, String>,
    /// What happens at the end time and to requests while paused.
    pub lifecycle: Lifecycle,
    /// Volumes to mount (by volume id; the caller resolved names and checked ownership).
    pub volumes: Vec<VolumeMount>,
}

/// A volume mounted into a sandbox: which one, where, how.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMount {
    /// The volume's id (its directory under the storage's `.volumes`).
    pub volume_id: String,
    /// Absolute mount point inside the sandbox.
    pub path: String,
    /// Mounted read-only.
    #[serde(default)]
    pub read_only: bool,
}

/// What happens to a sandbox at its end time and while it is paused (E2B's `autoPause`,
/// `autoPauseMemory`, `autoResume`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    /// Pause instead of kill at the end time.
    #[serde(default)]
    pub auto_pause: bool,
    /// That pause keeps memory (`full`); false: filesystem only.
    #[serde(default = "yes")]
    pub auto_pause_memory: bool,
    /// A data-plane request to the paused sandbox resumes it.
    #[serde(default)]
    pub auto_resume: bool,
}

fn yes() -> bool {
    true
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle {
            auto_pause: false,
            auto_pause_memory: true,
            auto_resume: false,
        }
    }
}

/// How a sandbox was paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Memory and disk: processes resume where they were.
    Full,
    /// Disk only: a resume boots the template again over the same files.
    Filesystem,
}

impl PauseMode {
    /// `full` or `filesystem` (E2B's `pauseMode`).
    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Full => "full",
            PauseMode::Filesystem => "filesystem",
        }
    }
}

/// Why a sandbox stopped existing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeathReason {
    /// The memory limit was hit and the kernel killed processes.
    Oom,
    /// Its end time passed; the node killed it.
    Timeout,
    /// Someone asked for it (`kill`).
    Killed,
    /// Its init (envd) exited on its own.
    Exited,
    /// Its writable layer ran out of quota.
    DiskFull,
}

impl DeathReason {
    /// `oom`, `timeout`, `killed`, `exited`, `disk_full`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeathReason::Oom => "oom",
            DeathReason::Timeout => "timeout",
            DeathReason::Killed => "killed",
            DeathReason::Exited => "exited",
            DeathReason::DiskFull => "disk_full",
        }
    }
}

impl std::fmt::Display for DeathReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Lifecycle state as stored on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Being created: never adopted after a crash.
    Creating,
    /// envd answered `/init`: adoptable after a node restart if still alive.
    Running,
    /// Being torn down.
    Dying,
    /// Being paused (a crash in this state: paused if the checkpoint is complete).
    Pausing,
    /// Paused: no processes, no host memory; its directory (disk, checkpoint) and slot
    /// are kept until it is resumed or killed.
    Paused,
    /// Gone (only in [`SandboxInfo`], never on disk).
    Dead,
}

/// `<state>/sandboxes/<id>/sandbox.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxRecord {
    /// Sandbox id.
    pub id: SandboxId,
    /// Template name.
    pub template: String,
    /// Lifecycle state.
    pub state: SandboxState,
    /// Uid slot; host ids `uid_base .. uid_base + 65536`.
    pub slot: u32,
    /// First host uid/gid of the sandbox's range (sandbox root).
    pub uid_base: u32,
    /// Host pid of the sandbox's init (envd), once started.
    #[serde(default)]
    pub pid: Option<i32>,
    /// Start time of that pid (field 22 of /proc/PID/stat) to detect pid reuse.
    #[serde(default)]
    pub pid_start_time: Option<u64>,
    /// Unix time in ms at creation.
    pub created_at_ms: u64,
    /// Unix time in ms after which the node kills it.
    pub end_at_ms: u64,
    /// Memory limit, MiB.
    pub memory_mb: u64,
    /// vCPUs.
    pub cpus: u32,
    /// Disk quota, MiB.
    pub disk_mb: u64,
    /// Internet on/off (a veth or loopback only).
    pub internet: bool,
    /// Egress policy.
    #[serde(default, skip_serializing_if = "NetworkPolicy::is_plain_default")]
    pub network: NetworkPolicy,
    /// `Host` for data-plane requests to the sandbox's ports (`${PORT}` replaced).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    /// Env vars given to envd.
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// User metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// envd access token.
    pub access_token: String,
    /// Default user given to envd.
    pub default_user: String,
    /// Default workdir given to envd: where commands without a `cwd` start. `None`:
    /// the acting user's home (as on E2B for templates that set no workdir).
    #[serde(default, deserialize_with = "crate::template::workdir_or_none")]
    pub default_workdir: Option<String>,
    /// Why it is dying (set before teardown).
    #[serde(default)]
    pub death_reason: Option<DeathReason>,
    /// Whatever the runtime needs to find its objects again (addresses, veth names, …).
    #[serde(default)]
    pub runtime: serde_json::Value,
    /// End-time and pause behaviour.
    #[serde(default)]
    pub lifecycle: Lifecycle,
    /// The timeout it was created with, in ms (an auto-resume uses it again).
    #[serde(default)]
    pub timeout_ms: u64,
    /// How it is paused (state `paused`).
    #[serde(default)]
    pub pause_mode: Option<PauseMode>,
    /// Unix ms it was paused at.
    #[serde(default)]
    pub paused_at_ms: Option<u64>,
    /// envd did not answer when it was paused.
    #[serde(default)]
    pub envd_unresponsive_at_pause: bool,
    /// The template whose root filesystem it runs on, when `template` names a snapshot.
    #[serde(default)]
    pub base_template: Option<String>,
    /// Volumes mounted in it (a volume a live sandbox mounts cannot be deleted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    /// The template's layer ids (what GC must keep while the sandbox runs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
}

impl SandboxRecord {
    /// The template that provides its root filesystem.
    pub fn rootfs_template(&self) -> &str {
        self.base_template.as_deref().unwrap_or(&self.template)
    }
}

/// A pidfd of a sandbox's init. It names that process and no other, even after the
/// process died and its pid was given to someone else: enter the sandbox's network
/// namespace through it (`setns` on a pidfd fails once the process has exited), never
/// through `/proc/<pid>/ns/net`. Cheap to clone (one shared descriptor).
#[derive(Debug, Clone)]
pub struct InitPidfd(Arc<OwnedFd>);

impl InitPidfd {
    /// A pidfd for `pid`, kept only if `pid` still is the process that started at
    /// `start_time` (checked after the pidfd pinned the process, so a pid reused in
    /// between is caught). `None`: that process is gone.
    pub fn open(pid: i32, start_time: Option<u64>) -> Option<InitPidfd> {
        let fd = cubicle_syscalls::pidfd::pidfd_open(pid).ok()?;
        crate::procfs::is_alive(pid, start_time).then(|| InitPidfd(Arc::new(fd)))
    }

    /// A pidfd the runtime already holds for the init (no check needed: it was opened
    /// for the process the runtime started or adopted).
    pub fn shared(fd: Arc<OwnedFd>) -> InitPidfd {
        InitPidfd(fd)
    }

    /// The descriptor.
    pub fn fd(&self) -> &Arc<OwnedFd> {
        &self.0
    }
}

/// What callers see of a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxInfo {
    /// Sandbox id.
    pub id: SandboxId,
    /// Template name.
    pub template: String,
    /// Lifecycle state.
    pub state: SandboxState,
    /// Why it died (when `state` is `dead`).
    pub death_reason: Option<DeathReason>,
    /// Unix ms at creation.
    pub created_at_ms: u64,
    /// Unix ms end time.
    pub end_at_ms: u64,
    /// Memory limit, MiB.
    pub memory_mb: u64,
    /// vCPUs.
    pub cpus: u32,
    /// Disk quota, MiB.
    pub disk_mb: u64,
    /// Internet on/off.
    pub internet: bool,
    /// Egress policy.
    pub network: NetworkPolicy,
    /// `Host` for data-plane requests to the sandbox's ports.
    pub mask_request_host: Option<String>,
    /// User metadata.
    pub metadata: BTreeMap<String, String>,
    /// envd access token (`envdAccessToken` of the E2B API).
    pub access_token: String,
    /// First host uid of the sandbox's range.
    pub uid_base: u32,
    /// Host pid of the sandbox's init (envd). For display: to reach into the sandbox use
    /// [`SandboxInfo::init_pidfd`].
    pub pid: Option<i32>,
    /// A pidfd of the init, while the node watches it (not for dead sandboxes).
    #[serde(skip)]
    pub init_pidfd: Option<InitPidfd>,
    /// envd's Unix socket on the host.
    pub envd_socket: PathBuf,
    /// How long create took until envd answered `/init`, in µs (0 for adopted sandboxes).
    pub ready_us: u64,
    /// End-time and pause behaviour.
    pub lifecycle: Lifecycle,
    /// A pause, resume, snapshot or rollback is under way: not routable for that moment.
    pub busy: bool,
    /// How it is paused (state `paused`).
    pub pause_mode: Option<PauseMode>,
    /// Unix ms it was paused at.
    pub paused_at_ms: Option<u64>,
    /// envd did not answer when it was paused.
    pub envd_unresponsive_at_pause: bool,
    /// The timeout it was created with.
    pub timeout_ms: u64,
    /// Processes the kernel's OOM killer killed in this sandbox: the live count for a
    /// running sandbox, the final count for a dead one (read just before teardown). A
    /// sandbox that survived an OOM kill and was then killed by its user dies `killed`,
    /// and this count is how its OOM history stays visible.
    pub oom_kills: u64,
    /// Volumes mounted in it.
    pub volumes: Vec<VolumeMount>,
    /// Whether this create was served from a warm pool (a claim) rather than cold.
    pub claimed: bool,
}

impl SandboxInfo {
    /// Info from a record.
    pub fn from_record(r: &SandboxRecord, envd_socket: PathBuf, ready_us: u64) -> Self {
        SandboxInfo {
            id: r.id.clone(),
            template: r.template.clone(),
            state: r.state,
            death_reason: r.death_reason,
            created_at_ms: r.created_at_ms,
            end_at_ms: r.end_at_ms,
            memory_mb: r.memory_mb,
            cpus: r.cpus,
            disk_mb: r.disk_mb,
            internet: r.internet,
            network: r.network.clone(),
            mask_request_host: r.mask_request_host.clone(),
            metadata: r.metadata.clone(),
            access_token: r.access_token.clone(),
            uid_base: r.uid_base,
            pid: r.pid,
            init_pidfd: None,
            envd_socket,
            ready_us,
            lifecycle: r.lifecycle,
            busy: false,
            pause_mode: r.pause_mode,
            paused_at_ms: r.paused_at_ms,
            envd_unresponsive_at_pause: r.envd_unresponsive_at_pause,
            timeout_ms: r.timeout_ms,
            oom_kills: 0,
            volumes: r.volumes.clone(),
            claimed: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_serialize_as_the_documented_words() {
        for (r, s) in [
            (DeathReason::Oom, "\"oom\""),
            (DeathReason::Timeout, "\"timeout\""),
            (DeathReason::Killed, "\"killed\""),
            (DeathReason::Exited, "\"exited\""),
            (DeathReason::DiskFull, "\"disk_full\""),
        ] {
            assert_eq!(serde_json::to_string(&r).unwrap(), s);
            assert_eq!(format!("\"{r}\""), s);
        }
    }
}
