//! What the API needs from the node, as a small trait: the real [`cubicle_node::Node`]
//! implements it, and the handler tests use an in-memory fake (fast, no root).

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use std::collections::HashSet;
use std::sync::Arc;

use cubicle_node::runtime::SandboxStats;
use cubicle_node::template::build::{BuildLog, BuildRequest, Cancel, FileResolver};
use cubicle_node::template::builds::BuildFailure;
use cubicle_node::template::{TemplateConfig, TemplateStore};
use cubicle_node::volume::VolumeFs;
use cubicle_node::{
    CreateRequest, NetEvent, NetworkPolicy, Node, PauseReport, PauseRequest, ResumeOutcome,
    SandboxInfo, SnapshotRecord, SnapshotReport, SnapshotRequest,
};

/// Where the upkeep's log mirror got to in each node's logs
/// ([`Backend::grown_logs`]): by node address, `""` for the local node.
pub type LogMarks = std::collections::HashMap<String, cubicle_node::init_log::LogMark>;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The sandbox operations the control plane drives.
pub trait Backend: Send + Sync + 'static {
    /// Whether template `name` exists or can be built on first use. Errors for a
    /// malformed name. Reads one small file of the template store (cheap enough inline).
    fn template_exists(&self, name: &str) -> cubicle_node::Result<bool>;
    /// Create a sandbox; returns once it is ready.
    fn create(&self, req: CreateRequest) -> BoxFuture<'_, cubicle_node::Result<SandboxInfo>>;
    /// Records the row of a sandbox this backend just made (create, fork) in `store`.
    /// Blocking. A replica coordinated through the cluster's database commits the
    /// create's placement instead (the row owned by its node, the reservation dropped);
    /// an error means the sandbox must not be kept.
    fn record_new(
        &self,
        store: &cubicle_store::Store,
        row: &cubicle_store::SandboxRow,
    ) -> cubicle_store::Result<()> {
        store.insert_sandbox(row)
    }
    /// Kill a sandbox.
    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>>;
    /// A live or recently dead sandbox.
    fn get(&self, id: &str) -> cubicle_node::Result<SandboxInfo>;
    /// [`Backend::get`] without the live counters (`oom_kills`): memory only.
    fn peek(&self, id: &str) -> cubicle_node::Result<SandboxInfo> {
        self.get(id)
    }
    /// A sandbox as it is now, for the control plane's per-sandbox routes: what
    /// [`Backend::peek`] says, except on a replica of a cluster, whose memory another
    /// replica's pause, resume, move or kill leaves stale until its next poll; there it
    /// asks the sandbox's owner (the data plane keeps to `peek`).
    fn current<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<SandboxInfo>> {
        Box::pin(async move { self.peek(id) })
    }
    /// Before a listing: on a replica of a cluster, what every node holds now, so that
    /// another replica's creates, pauses and kills are listed at once rather than at this
    /// replica's next poll. Elsewhere there is nothing to refresh.
    fn refresh_all(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// End time := now + `timeout`. Blocking (writes the node's record).
    fn set_timeout(&self, id: &str, timeout: Duration) -> cubicle_node::Result<()>;
    /// Usage counters. Blocking (reads cgroup files).
    fn stats(&self, id: &str) -> cubicle_node::Result<SandboxStats>;
    /// The node's log file of the sandbox's PID 1 (envd) output on the host.
    fn log_path(&self, id: &str) -> PathBuf;
    /// The idle connection to running sandbox `id`'s envd its create left open, for the
    /// data plane's first request (`None`: the data plane connects).
    fn take_envd_conn(&self, id: &str) -> Option<std::os::unix::net::UnixStream> {
        let _ = id;
        None
    }
    /// Warm-pool counters (ready, target, claims, misses, refills).
    fn pool(&self) -> cubicle_node::PoolStats {
        cubicle_node::PoolStats::default()
    }
    /// The same, as JSON (`GET /cubicle/pool`).
    fn pool_stats(&self) -> serde_json::Value {
        serde_json::to_value(self.pool()).unwrap_or_default()
    }
    /// The host's CPU, memory and disk (reads a few `/proc` files and one `statvfs`).
    fn host(&self) -> cubicle_node::host::HostStats {
        cubicle_node::host::HostStats::default()
    }
    /// How many connections the node's egress proxy relays now (`None`: not known here).
    fn egress_relayed(&self) -> Option<u64> {
        None
    }
    /// Create volume `id` with a limit of `size_mb` MiB.
    fn create_volume<'a>(
        &'a self,
        id: &'a str,
        size_mb: u64,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        let _ = size_mb;
        Box::pin(async move { Err(cubicle_node::Error::VolumeNotFound(id.to_string())) })
    }
    /// Delete volume `id` (refused while a sandbox mounts it).
    fn delete_volume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async move { Err(cubicle_node::Error::VolumeNotFound(id.to_string())) })
    }
    /// The files of volume `id`. Blocking.
    fn volume_fs(&self, id: &str) -> cubicle_node::Result<VolumeFs> {
        Err(cubicle_node::Error::VolumeNotFound(id.to_string()))
    }
    /// Bytes used and the limit of volume `id`. Blocking.
    fn volume_usage(&self, id: &str) -> cubicle_node::Result<(u64, u64)> {
        Err(cubicle_node::Error::VolumeNotFound(id.to_string()))
    }
    /// The volumes on disk (half-created ones removed).
    fn reconcile_volumes(&self) -> BoxFuture<'_, cubicle_node::Result<Vec<String>>> {
        Box::pin(async { Ok(Vec::new()) })
    }
    /// The template store (`None`: this backend cannot build templates).
    fn templates(&self) -> Option<TemplateStore> {
        None
    }
    /// The owner label of a custom template (`None`: public, e.g. a built-in).
    fn template_owner(&self, name: &str) -> Option<String> {
        self.templates().and_then(|t| t.owner(name))
    }
    /// Run a template build in this backend's sandboxes.
    fn run_build(
        &self,
        req: BuildRequest,
        files: Arc<FileResolver>,
        log: Arc<BuildLog>,
        cancel: Cancel,
    ) -> BoxFuture<'static, Result<TemplateConfig, BuildFailure>> {
        let _ = (req, files, log, cancel);
        Box::pin(async {
            Err(BuildFailure {
                message: "this server cannot build templates".into(),
                step: None,
            })
        })
    }
    /// Called once a build of template `name` is published in this backend's template
    /// store, before the build reports ready: a cluster node publishes it to the object
    /// store so that every node can create from it (`Some(what was done)`).
    fn template_built<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, cubicle_node::Result<Option<String>>> {
        let _ = name;
        Box::pin(async { Ok(None) })
    }
    /// The replica's backend when this is one (template and volume requests are
    /// relayed to nodes through it: `crate::cluster::templates`).
    fn cluster(&self) -> Option<&crate::cluster::RemoteBackend> {
        None
    }
    /// What uses template `name`: ids of its sandboxes that are not dying (running or
    /// paused), then `snapshot <id>` for its snapshots.
    fn sandboxes_of(&self, name: &str) -> Vec<String> {
        let _ = name;
        Vec::new()
    }
    /// Layer ids sandboxes (running or paused) and snapshots use (kept by GC).
    fn layers_in_use(&self) -> HashSet<String> {
        HashSet::new()
    }
    /// Checks a policy's DNS servers and egress proxy against the node's rules.
    fn check_network<'a>(
        &'a self,
        _policy: &'a NetworkPolicy,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async { Ok(()) })
    }
    /// Replaces a running sandbox's egress policy.
    fn update_network<'a>(
        &'a self,
        id: &'a str,
        _policy: NetworkPolicy,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(async move {
            Err(cubicle_node::Error::Runtime(format!(
                "this backend cannot change the network of {id}"
            )))
        })
    }
    /// A sandbox's network audit trail after `after` (at most `limit` events).
    fn network_log<'a>(
        &'a self,
        _id: &'a str,
        _after: u64,
        _limit: usize,
    ) -> BoxFuture<'a, Vec<NetEvent>> {
        Box::pin(async { Vec::new() })
    }
    /// Deletes a sandbox's network audit trail.
    fn forget_network_log(&self, _id: &str) {}
    /// Brings [`Backend::log_path`] up to date when the log lives elsewhere (a replica
    /// copies what the owning node's log gained); nothing to do on the node itself.
    fn fetch_log<'a>(&'a self, _id: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }
    /// Deletes what [`Backend::fetch_log`] copied (the sandbox's record was purged).
    fn forget_log(&self, _id: &str) {}
    /// The sandboxes whose log ([`Backend::log_path`]) may have grown since the marks in
    /// `marks` (one per node, which this updates), so that the upkeep mirrors only those
    /// and not, every second, every sandbox. `None`: cannot tell, any may have.
    fn grown_logs<'a>(&'a self, marks: &'a mut LogMarks) -> BoxFuture<'a, Option<HashSet<String>>> {
        let _ = marks;
        Box::pin(async { None })
    }
    /// Pause a running sandbox.
    fn pause<'a>(
        &'a self,
        id: &'a str,
        req: PauseRequest,
    ) -> BoxFuture<'a, cubicle_node::Result<PauseReport>> {
        let _ = (id, req);
        Box::pin(async { Err(unsupported()) })
    }
    /// Resume a paused sandbox (or extend a running one's end time).
    fn resume<'a>(
        &'a self,
        id: &'a str,
        timeout: Duration,
        memory: bool,
    ) -> BoxFuture<'a, cubicle_node::Result<ResumeOutcome>> {
        let _ = (id, timeout, memory);
        Box::pin(async { Err(unsupported()) })
    }
    /// Snapshot a running sandbox.
    fn snapshot<'a>(
        &'a self,
        id: &'a str,
        req: SnapshotRequest,
    ) -> BoxFuture<'a, cubicle_node::Result<SnapshotReport>> {
        let _ = (id, req);
        Box::pin(async { Err(unsupported()) })
    }
    /// Fork a running sandbox `count` times.
    fn fork<'a>(
        &'a self,
        id: &'a str,
        count: usize,
        timeout: Duration,
    ) -> BoxFuture<'a, cubicle_node::Result<Vec<cubicle_node::Result<SandboxInfo>>>> {
        let _ = (id, count, timeout);
        Box::pin(async { Err(unsupported()) })
    }
    /// Roll a sandbox back to one of its snapshots.
    fn rollback<'a>(
        &'a self,
        id: &'a str,
        snapshot: &'a str,
    ) -> BoxFuture<'a, cubicle_node::Result<Duration>> {
        let _ = (id, snapshot);
        Box::pin(async { Err(unsupported()) })
    }
    /// Every visible snapshot.
    fn snapshots(&self) -> Vec<SnapshotRecord> {
        Vec::new()
    }
    /// The snapshot `name` refers to.
    fn find_snapshot(&self, name: &str) -> Option<SnapshotRecord> {
        let _ = name;
        None
    }
    /// Delete a snapshot.
    fn delete_snapshot<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>> {
        let _ = id;
        Box::pin(async { Err(unsupported()) })
    }
}

fn unsupported() -> cubicle_node::Error {
    cubicle_node::Error::Unsupported(
        "pause, snapshots and fork are not supported by this node".into(),
    )
}

impl Backend for Node {
    fn check_network<'a>(
        &'a self,
        policy: &'a NetworkPolicy,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(Node::check_network(self, policy))
    }

    fn update_network<'a>(
        &'a self,
        id: &'a str,
        policy: NetworkPolicy,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(Node::update_network(self, id, policy))
    }

    fn network_log<'a>(
        &'a self,
        id: &'a str,
        after: u64,
        limit: usize,
    ) -> BoxFuture<'a, Vec<NetEvent>> {
        Box::pin(Node::network_log(self, id, after, limit))
    }

    fn forget_network_log(&self, id: &str) {
        Node::forget_network_log(self, id)
    }

    fn take_envd_conn(&self, id: &str) -> Option<std::os::unix::net::UnixStream> {
        Node::take_envd_conn(self, id)
    }
    fn pool(&self) -> cubicle_node::PoolStats {
        Node::pool_stats(self)
    }

    fn host(&self) -> cubicle_node::host::HostStats {
        cubicle_node::host::stats(&self.config().state_dir)
    }

    fn egress_relayed(&self) -> Option<u64> {
        Node::egress_relayed(self).map(|n| n as u64)
    }

    fn template_exists(&self, name: &str) -> cubicle_node::Result<bool> {
        if let Some((n, tag)) = name.split_once(':') {
            return Ok(Node::templates(self).get_tagged(n, Some(tag))?.is_some());
        }
        Ok(Node::templates(self).get(name)?.is_some()
            || cubicle_node::template::BUILTINS.contains(&name))
    }

    fn templates(&self) -> Option<TemplateStore> {
        Some(Node::templates(self).clone())
    }

    fn run_build(
        &self,
        req: BuildRequest,
        files: Arc<FileResolver>,
        log: Arc<BuildLog>,
        cancel: Cancel,
    ) -> BoxFuture<'static, Result<TemplateConfig, BuildFailure>> {
        let host = cubicle_node::build::NodeBuildHost::new(self.clone());
        let store = Node::templates(self).clone();
        Box::pin(async move {
            cubicle_node::template::build::build(&host, &store, &req, &*files, &log, cancel).await
        })
    }

    fn template_built<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, cubicle_node::Result<Option<String>>> {
        Box::pin(async move {
            if self.object_store().is_none() {
                return Ok(None);
            }
            let r = Node::push_template(self, name).await?;
            Ok(Some(format!(
                "published to the object store ({} blob(s), {} bytes, {} ms)",
                r.blobs_moved,
                r.bytes_moved,
                r.took.as_millis()
            )))
        })
    }

    fn sandboxes_of(&self, name: &str) -> Vec<String> {
        // A dying sandbox no longer counts (GC keeps its layers until it is gone); a
        // paused one or a snapshot does (it restores onto the template's layers).
        Node::template_users(self, name)
    }

    fn layers_in_use(&self) -> HashSet<String> {
        Node::layers_in_use(self)
    }

    fn create(&self, req: CreateRequest) -> BoxFuture<'_, cubicle_node::Result<SandboxInfo>> {
        Box::pin(Node::create(self, req))
    }

    fn kill<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(Node::kill(self, id))
    }

    fn get(&self, id: &str) -> cubicle_node::Result<SandboxInfo> {
        Node::get(self, id)
    }

    fn peek(&self, id: &str) -> cubicle_node::Result<SandboxInfo> {
        Node::peek(self, id)
    }

    fn set_timeout(&self, id: &str, timeout: Duration) -> cubicle_node::Result<()> {
        Node::set_timeout(self, id, timeout)
    }

    fn stats(&self, id: &str) -> cubicle_node::Result<SandboxStats> {
        Node::stats(self, id)
    }

    fn log_path(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join(cubicle_node::init_log::INIT_LOG)
    }

    fn grown_logs<'a>(&'a self, marks: &'a mut LogMarks) -> BoxFuture<'a, Option<HashSet<String>>> {
        let grown = Node::grown_logs(self, marks.get("").copied());
        Box::pin(async move {
            let grown = grown?;
            marks.insert(String::new(), grown.mark);
            grown.ids.map(|ids| ids.into_iter().collect())
        })
    }

    fn create_volume<'a>(
        &'a self,
        id: &'a str,
        size_mb: u64,
    ) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(Node::create_volume(self, id, size_mb))
    }

    fn delete_volume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(Node::delete_volume(self, id))
    }

    fn volume_fs(&self, id: &str) -> cubicle_node::Result<VolumeFs> {
        Node::volume_fs(self, id)
    }

    fn volume_usage(&self, id: &str) -> cubicle_node::Result<(u64, u64)> {
        Node::volume_usage(self, id)
    }

    fn reconcile_volumes(&self) -> BoxFuture<'_, cubicle_node::Result<Vec<String>>> {
        Box::pin(Node::reconcile_volumes(self))
    }

    fn pause<'a>(
        &'a self,
        id: &'a str,
        req: PauseRequest,
    ) -> BoxFuture<'a, cubicle_node::Result<PauseReport>> {
        Box::pin(Node::pause(self, id, req))
    }

    fn resume<'a>(
        &'a self,
        id: &'a str,
        timeout: Duration,
        memory: bool,
    ) -> BoxFuture<'a, cubicle_node::Result<ResumeOutcome>> {
        Box::pin(Node::resume(self, id, timeout, memory))
    }

    fn snapshot<'a>(
        &'a self,
        id: &'a str,
        req: SnapshotRequest,
    ) -> BoxFuture<'a, cubicle_node::Result<SnapshotReport>> {
        Box::pin(Node::snapshot(self, id, req))
    }

    fn fork<'a>(
        &'a self,
        id: &'a str,
        count: usize,
        timeout: Duration,
    ) -> BoxFuture<'a, cubicle_node::Result<Vec<cubicle_node::Result<SandboxInfo>>>> {
        Box::pin(Node::fork(self, id, count, timeout))
    }

    fn rollback<'a>(
        &'a self,
        id: &'a str,
        snapshot: &'a str,
    ) -> BoxFuture<'a, cubicle_node::Result<Duration>> {
        Box::pin(Node::rollback(self, id, snapshot))
    }

    fn snapshots(&self) -> Vec<SnapshotRecord> {
        Node::snapshots(self)
    }

    fn find_snapshot(&self, name: &str) -> Option<SnapshotRecord> {
        Node::find_snapshot(self, name)
    }

    fn delete_snapshot<'a>(&'a self, id: &'a str) -> BoxFuture<'a, cubicle_node::Result<()>> {
        Box::pin(Node::delete_snapshot(self, id))
    }
}
