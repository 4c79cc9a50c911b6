//! The node's view of the isolation layer: a small trait ([`SandboxRuntime`]) the node
//! drives, and its implementation on top of `cubicle-runtime` ([`crate::linux`]).
//!
//! Keeping the node behind this trait lets its lifecycle logic (slots, records,
//! reconciliation, timers) be written and unit-tested independently of the kernel work,
//! and lets a microVM runtime plug in later.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use cubicle_runtime::SandboxId;

use crate::error::Result;
use crate::sandbox::DeathReason;

/// Everything the runtime needs to start one sandbox.
#[derive(Debug, Clone)]
pub struct StartSpec {
    /// Sandbox id (`^[a-z0-9]{1,32}$`).
    pub id: SandboxId,
    /// Template rootfs (read-only lower layer, owned by host uid 0).
    pub rootfs: PathBuf,
    /// The template's further layers above `rootfs`, bottom first.
    pub layers: Vec<PathBuf>,
    /// `<state>/sandboxes/<id>`: the sandbox's private host directory.
    pub sandbox_dir: PathBuf,
    /// The node's slot for this sandbox (uid range and network address derive from it).
    pub slot: u32,
    /// Host uid/gid of root inside.
    pub uid_base: u32,
    /// Number of mapped ids.
    pub uid_count: u32,
    /// Memory limit in MiB.
    pub memory_mb: u64,
    /// vCPUs.
    pub cpus: u32,
    /// Max tasks.
    pub pids: u32,
    /// Writable-layer quota in MiB.
    pub disk_mb: u64,
    /// veth + NAT (true) or loopback only.
    pub internet: bool,
    /// Egress policy (applied right after the veth, before envd is asked anything).
    pub network: crate::sandbox::NetworkPolicy,
    /// Hostname inside.
    pub hostname: String,
    /// Host path of the envd binary, bind-mounted read-only at `/run/cubicle/envd`.
    pub envd_binary: PathBuf,
    /// argv of PID 1 (envd).
    pub init: Vec<String>,
    /// Environment of PID 1.
    pub env: BTreeMap<String, String>,
    /// Extra bind mounts: (host path, path inside, read-only).
    pub binds: Vec<(PathBuf, PathBuf, bool)>,
    /// Volumes, mounted idmapped: (host path, path inside, read-only).
    pub volumes: Vec<(PathBuf, PathBuf, bool)>,
    /// The Unix socket PID 1 serves on: a file name in `<sandbox_dir>/ctl`, created
    /// (listening) before PID 1 runs and passed to it as descriptor
    /// `cubicle_runtime::LISTEN_FD`.
    pub ctl_socket: String,
    /// A shell (`pool/shell.rs`): no template's root yet (`rootfs` and `layers` unused,
    /// `binds` and `volumes` empty); [`SandboxRuntime::attach_root`] gives it one.
    pub shell: bool,
}

/// What the runtime reports after a successful start.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Started {
    /// Host pid of the sandbox's init.
    pub pid: i32,
    /// Runtime-private facts to store in the sandbox record (e.g. addresses).
    #[serde(default)]
    pub state: serde_json::Value,
}

/// Usage counters of one sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStats {
    /// Memory in use (cgroup), bytes.
    pub memory_bytes: u64,
    /// Processes the OOM killer killed in the sandbox so far.
    pub oom_kills: u64,
    /// CPU time used, ns.
    pub cpu_usage_ns: u64,
    /// Tasks now.
    pub pids: u64,
    /// Forks refused so far because the sandbox hit its task limit (pids.max).
    pub pids_limit_hits: u64,
    /// Bytes written to the writable layer (when quotas are available).
    pub disk_used_bytes: Option<u64>,
    /// The writable layer's quota (when quotas are available).
    pub disk_limit_bytes: Option<u64>,
}

/// A checkpoint to take of a running sandbox.
#[derive(Debug, Clone)]
pub struct CheckpointSpec<'a> {
    /// The sandbox as it was started (its mounts decide what is saved how).
    pub start: &'a StartSpec,
    /// Host pid of its init.
    pub pid: i32,
    /// Directory for the checkpoint (created; must not exist).
    pub dir: PathBuf,
    /// Let it run on (snapshot, fork) instead of ending it (pause).
    pub leave_running: bool,
    /// Also take a copy-on-write copy of its whole directory (writable layer and the
    /// checkpoint) under this name, at the same frozen instant.
    pub snapshot: Option<String>,
    /// Save memory and processes (CRIU); false: only the [`snapshot`](Self::snapshot)
    /// of the disk, taken while the sandbox is frozen (`leave_running` must be true).
    pub memory: bool,
}

/// How a checkpoint went.
#[derive(Debug, Clone, Default)]
pub struct CheckpointInfo {
    /// How long the sandbox was stopped.
    pub frozen: std::time::Duration,
    /// The whole operation.
    pub total: std::time::Duration,
    /// Bytes written.
    pub bytes: u64,
    /// Step timings from the start.
    pub phases: Vec<(String, std::time::Duration)>,
}

/// The isolation layer, as the node uses it. All methods block (call them from
/// `spawn_blocking`); all are safe to call from several threads.
///
/// Checkpoints (pause/resume, snapshots, forks, rollback) are optional: a runtime that
/// cannot take them keeps the default methods, which say so.
pub trait SandboxRuntime: Send + Sync + 'static {
    /// Start a sandbox (namespaces, rootfs, cgroup, network, quota, init). On error
    /// nothing of it must remain.
    fn start(&self, spec: &StartSpec) -> Result<Started>;

    /// Re-attach to sandbox `id` left running by an earlier node process; returns the
    /// host pid of its init.
    fn adopt(&self, id: &str, sandbox_dir: &std::path::Path) -> Result<i32>;

    /// Create the sandbox's private directory `dir` (= `<state>/sandboxes/<id>`) with a
    /// disk quota of `disk_mb` on everything written below it, where supported.
    fn create_dir(&self, id: &str, dir: &std::path::Path, disk_mb: u64) -> Result<()>;

    /// Remove the sandbox's directory (and its quota). Idempotent.
    fn remove_dir(&self, id: &str, dir: &std::path::Path) -> Result<()>;

    /// Remove every sandbox directory and quota not in `known` (after a crash).
    fn reconcile_storage(&self, known: &[String]) -> Result<()>;

    /// Kill every process of sandbox `id` and remove all its kernel objects (cgroup,
    /// veth/nft entries of `slot`, quota, mounts under `sandbox_dir`). Idempotent: missing
    /// pieces are fine. Does not delete `sandbox_dir` itself (the node does).
    fn destroy(&self, id: &str, slot: Option<u32>, sandbox_dir: &std::path::Path) -> Result<()>;

    /// Holds the network namespace of sandbox `id` (in `slot`) just before its processes
    /// are killed and left for a later [`destroy`](Self::destroy) (the node's quick
    /// kill): its interface then outlives its processes, so `destroy` reads, once
    /// nothing in it can send, whether it ever sent a packet, and skips the connection
    /// cleanup for one that never did. Best effort.
    fn hold_network(&self, _id: &str, _slot: u32) {}

    /// Remove network objects (veths, nft elements) of every slot in `owned` (this node's
    /// range: other nodes on the host own the other slots) not in `known_slots`.
    fn reconcile_network(&self, owned: std::ops::Range<u32>, known_slots: &[u32]) -> Result<()>;

    /// If a limit explains why sandbox `id` died or is dying (OOM kills counted in its
    /// cgroup, a full disk quota), say which.
    fn limit_hit(&self, id: &str, sandbox_dir: &std::path::Path) -> Option<DeathReason>;

    /// Host memory the sandbox's cgroup uses now, in bytes.
    fn memory_usage(&self, id: &str) -> Option<u64>;

    /// Usage counters of a live sandbox.
    fn stats(&self, id: &str) -> Option<SandboxStats>;

    /// The sandboxes whose PID 1 log grew after `since` (see
    /// [`crate::init_log::InitLogs::grown_since`]). `None`: this runtime cannot tell,
    /// any log may have.
    fn grown_logs(
        &self,
        _since: Option<crate::init_log::LogMark>,
    ) -> Option<crate::init_log::GrownLogs> {
        None
    }

    /// A pidfd of sandbox `id`'s init that the runtime already holds, to share rather
    /// than open another: a node with 10,000 sandboxes counts its descriptors (see
    /// `cubicle_runtime::fd_limit`). `None`: the caller opens its own.
    fn init_pidfd(&self, _id: &str) -> Option<std::sync::Arc<std::os::fd::OwnedFd>> {
        None
    }

    /// Rewrite a running sandbox's memory and CPU limits (a pooled sandbox being claimed
    /// with other limits than its template's).
    fn set_limits(&self, id: &str, memory_mb: u64, cpus: u32, pids: u32) -> Result<()>;

    /// Scale sandbox `id`'s CPU weight as a task's at nice `nice` (pooled sandboxes are
    /// made at low priority and raised when claimed). Its tasks run at nice 0 whatever
    /// the weight: one cgroup file, not every task.
    fn set_cpu_nice(&self, id: &str, nice: i32);

    /// Number of slots the runtime can address (network pool size etc.).
    fn max_slots(&self) -> u32;

    /// Applies `policy` to running sandbox `id` (slot `slot`, init `pid`): gives it a
    /// network interface if the policy needs one and it has none, replaces the kernel's
    /// share of its policy and tells the egress layer (also after a node restart, for
    /// an adopted sandbox). Returns whether the sandbox has a network interface now.
    /// Of the connections it opened before, the egress proxy cuts those it relays and
    /// the new policy refuses; the direct ones are left to [`Self::cut_refused`].
    fn set_network(
        &self,
        _id: &str,
        _slot: u32,
        _pid: i32,
        policy: &crate::sandbox::NetworkPolicy,
    ) -> Result<bool> {
        Ok(policy.needs_network())
    }

    /// Cuts the direct connections running sandbox `id` (slot `slot`) opened to
    /// destinations `policy` (just applied by [`Self::set_network`]) refuses by
    /// address: the rules accept established connections before they look at the
    /// policy (`cubicle_runtime::network::Network::forget_refused`); the sandbox's own
    /// ends of them fail at once.
    fn cut_refused(
        &self,
        _id: &str,
        _slot: u32,
        _policy: &crate::sandbox::NetworkPolicy,
    ) -> Result<()> {
        Ok(())
    }

    /// How many connections the egress proxy relays now (`None`: no egress layer).
    fn egress_relayed(&self) -> Option<usize> {
        None
    }

    /// Sandbox `id`'s network audit trail: events after `after`, at most `limit`.
    fn network_log(&self, _id: &str, _after: u64, _limit: usize) -> Vec<cubicle_egress::NetEvent> {
        Vec::new()
    }

    /// Deletes sandbox `id`'s network audit trail (its records are being purged).
    fn forget_network_log(&self, _id: &str) {}

    /// Stops the runtime's background services (the egress layer) when the node closes;
    /// sandboxes keep running.
    fn close(&self) {}

    /// Restores the disk limits' enforcement if the quota filesystem lost it (btrfs
    /// stops accounting once it marks its qgroups inconsistent). `Ok(true)` when a repair
    /// (a rescan) was started. The reaper calls it every few seconds.
    fn keep_quotas_enforced(&self) -> Result<bool> {
        Ok(false)
    }

    /// After the node closed with no sandbox left: unmounts the quota filesystem the
    /// runtime mounted (best effort; the next start mounts it again).
    fn release_storage(&self) {}

    /// The egress layer, when this runtime has one.
    fn egress(&self) -> Option<cubicle_egress::Egress> {
        None
    }

    /// Kills every process of sandbox `id` and removes its cgroup and the network
    /// objects of `slot`, keeping its directory (a pause without memory, a rollback).
    fn stop(&self, id: &str, slot: u32) -> Result<()> {
        let _ = (id, slot);
        Err(crate::error::Error::Unsupported(
            "this runtime cannot stop a sandbox and keep its disk".into(),
        ))
    }

    /// `Ok` when this runtime can checkpoint and restore sandboxes here; else why not.
    fn checkpoint_support(&self) -> std::result::Result<(), String> {
        Err("this runtime cannot checkpoint sandboxes".into())
    }

    /// Checkpoints a running sandbox (see [`CheckpointSpec`]). On failure nothing of
    /// the checkpoint remains and the sandbox still runs.
    fn checkpoint(&self, spec: &CheckpointSpec<'_>) -> Result<CheckpointInfo> {
        let _ = spec;
        Err(crate::error::Error::Unsupported(
            "this runtime cannot checkpoint sandboxes".into(),
        ))
    }

    /// Starts a sandbox from the checkpoint in `checkpoint_dir` (its writable layer
    /// already in `spec.sandbox_dir`). On error nothing of it remains running (its
    /// directory is the caller's).
    fn restore(&self, spec: &StartSpec, checkpoint_dir: &std::path::Path) -> Result<Started> {
        let _ = (spec, checkpoint_dir);
        Err(crate::error::Error::Unsupported(
            "this runtime cannot restore sandboxes".into(),
        ))
    }

    /// Makes `dir` (sandbox `id`'s directory, quota `disk_mb`) a copy-on-write copy of the
    /// snapshot `snapshot`.
    fn clone_snapshot(
        &self,
        snapshot: &str,
        id: &str,
        dir: &std::path::Path,
        disk_mb: u64,
    ) -> Result<()> {
        let _ = (snapshot, id, dir, disk_mb);
        Err(crate::error::Error::Unsupported(
            "this runtime has no snapshots".into(),
        ))
    }

    /// Makes snapshot `snapshot` a copy-on-write copy of the directory of sandbox `id`,
    /// which runs nothing (a snapshot pulled from the object store is unpacked into a
    /// scratch sandbox directory first, then sealed as a snapshot with this).
    fn seal_snapshot(&self, id: &str, snapshot: &str) -> Result<()> {
        let _ = (id, snapshot);
        Err(crate::error::Error::Unsupported(
            "this runtime has no snapshots".into(),
        ))
    }

    /// The directory of snapshot `snapshot`.
    fn snapshot_dir(&self, snapshot: &str) -> Result<std::path::PathBuf> {
        let _ = snapshot;
        Err(crate::error::Error::Unsupported(
            "this runtime has no snapshots".into(),
        ))
    }

    /// Deletes snapshot `snapshot` (idempotent).
    fn remove_snapshot(&self, snapshot: &str) -> Result<()> {
        let _ = snapshot;
        Ok(())
    }

    /// Names of the snapshots the runtime holds.
    fn snapshots(&self) -> Result<Vec<String>> {
        Ok(Vec::new())
    }

    /// Volumes (`crate::volume`): the host directory of volume `id` (whether or not it
    /// exists). Runtimes without volume support refuse.
    fn volume_dir(&self, id: &str) -> Result<PathBuf> {
        Err(no_volumes(id))
    }

    /// Creates volume `id` with a limit of `size_mb` on everything written in it; its
    /// root belongs to `uid:gid` (as sandboxes see them) with `mode`.
    fn create_volume(&self, id: &str, size_mb: u64, uid: u32, gid: u32, mode: u32) -> Result<()> {
        let _ = (size_mb, uid, gid, mode);
        Err(no_volumes(id))
    }

    /// Deletes volume `id` with its contents (idempotent). No sandbox may mount it.
    fn remove_volume(&self, id: &str) -> Result<()> {
        Err(no_volumes(id))
    }

    /// Bytes used and the limit of volume `id`.
    fn volume_usage(&self, id: &str) -> Result<(u64, u64)> {
        Err(no_volumes(id))
    }

    /// The volumes on disk; removes half-created ones.
    fn reconcile_volumes(&self) -> Result<Vec<String>> {
        Ok(Vec::new())
    }

    /// Gives the running shell `spec.id` (started from a [`StartSpec`] with `shell`) the
    /// root `spec` describes: its template's layers, binds and volumes, its init running
    /// on. On an error the sandbox is to be destroyed.
    fn attach_root(&self, spec: &StartSpec) -> Result<()> {
        Err(crate::error::Error::Runtime(format!(
            "this runtime makes no shells ({})",
            spec.id
        )))
    }

    /// Mounts `volumes` ((host path, path inside, read-only), idmapped) into the running
    /// sandbox `id`, whose init is `pid` (pinned by `pidfd`) and whose root is host
    /// uid `uid_base` (a pooled sandbox being claimed).
    fn attach_volumes(
        &self,
        id: &str,
        pidfd: std::os::fd::BorrowedFd<'_>,
        pid: i32,
        uid_base: u32,
        volumes: &[(PathBuf, PathBuf, bool)],
    ) -> Result<()> {
        let _ = (pidfd, pid, uid_base, volumes);
        Err(no_volumes(id))
    }
}

fn no_volumes(what: &str) -> crate::error::Error {
    crate::error::Error::Runtime(format!(
        "volumes are not supported by this runtime ({what})"
    ))
}
