//! [`Node`]: the sandboxes of one host.
//!
//! A sandbox's life on a node:
//! 1. `create` reserves an id and a uid slot, writes `<state>/sandboxes/<id>/sandbox.json`
//!    (state `creating`) *before* touching the kernel, asks the runtime to start it
//!    (PID 1 = envd), waits for envd's `/health` on `<dir>/ctl/envd.sock`, POSTs `/init`,
//!    and marks the record `running`.
//! 2. It dies by `kill` (`killed`), by its end time (`timeout`, enforced by the node's
//!    reaper task), or on its own (`exited`, `oom`, `disk_full`, noticed through a pidfd).
//!    The reason is written to the record, then the runtime tears everything down, the
//!    directory is removed and only then the slot is freed.
//! 3. After a crash, [`Node::open`] reconciles (see `reconcile.rs`).
//!
//! This file is the node's public interface. The shared state every path works on is
//! `inner.rs`, the create path `create.rs`, the death path `teardown.rs`, a running
//! sandbox's network policy and audit trail `network.rs`; the pools
//! (`crate::pool`) use the create path and the shared state, never this file.

use std::collections::VecDeque;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use cubicle_runtime::SandboxId;

use crate::config::NodeConfig;
use crate::envd_client::EnvdClient;
use crate::error::{Error, IoContext, Result};
use crate::pool::{Claim, PoolStats};
use crate::runtime::SandboxRuntime;
use crate::sandbox::{CreateRequest, DeathReason, SandboxInfo, SandboxRecord, SandboxState};
use crate::slots::UidSlots;
use crate::template::{Template, TemplateStore};
use crate::{fsutil, procfs};

pub(crate) mod create;
pub(crate) mod handover;
pub(crate) mod idle_conn;
pub(crate) mod inner;
pub(crate) mod moving;
mod network;
pub(crate) mod stateful;
pub(crate) mod teardown;

pub use handover::{OwnerRecord, PublishedCopies, TakeoverReport, identity_of};
pub use moving::{
    BlobRef, MoveReport, Mover, ObjectStoreConfig, PausedManifest, SnapshotManifest,
    TemplateManifest,
};
pub use stateful::{
    CHECKPOINT_DIR, DISCARDED_CHECKPOINT_PREFIX, PauseReport, PauseRequest, ResumeOutcome,
    SnapshotReport, SnapshotRequest,
};

use inner::{Inner, State, blocking, lock_node, now_ms};

/// Path of envd inside the sandbox (where the runtime mounts it).
pub const ENVD_IN_SANDBOX: &str = cubicle_runtime::ENVD_PATH;
/// envd's Unix socket: its file name in `<sandbox dir>/ctl` (read-only inside the sandbox,
/// at `/run/cubicle/ctl`: `cubicle_proto::ENVD_SOCKET_IN_SANDBOX`). The runtime creates it and passes it to envd as descriptor
/// `cubicle_runtime::LISTEN_FD`.
pub const ENVD_SOCKET: &str = "envd.sock";

/// How long a kill waits for a pause, resume, snapshot or rollback of its sandbox under
/// way before it gives up with a conflict (a large code-interpreter pause under load
/// takes seconds).
const KILL_WAITS_FOR_BUSY: Duration = Duration::from_secs(60);

/// The sandboxes of one host. Cheap to clone.
#[derive(Clone)]
pub struct Node {
    pub(crate) inner: Arc<Inner>,
}

impl Node {
    /// Open the node on `config.state_dir` with the given runtime: create the state
    /// layout, reconcile whatever a previous run left (adopt live sandboxes it knows,
    /// remove everything else), and start the reaper that enforces end times.
    pub async fn open_with_runtime(
        config: NodeConfig,
        runtime: Arc<dyn SandboxRuntime>,
    ) -> Result<Node> {
        let lock = Node::lock_state_dir(&config.state_dir, config.wait_for_lock).await?;
        Node::open_locked(config, runtime, lock, None).await
    }

    /// Take the state directory's node lock (one node per state directory). When another
    /// process holds it: wait for it (`wait`), or fail at once naming that process.
    pub(crate) async fn lock_state_dir(state_dir: &Path, wait: bool) -> Result<std::fs::File> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(state_dir)
            .ctx("mkdir", state_dir)?;
        let p = state_dir.join("node.lock");
        blocking(move || lock_node(&p, wait)).await
    }

    pub(crate) async fn open_locked(
        config: NodeConfig,
        runtime: Arc<dyn SandboxRuntime>,
        node_lock: std::fs::File,
        slot_lease: Option<crate::host_slots::SlotLease>,
    ) -> Result<Node> {
        let state_dir = config.state_dir.clone();
        for d in [state_dir.clone(), state_dir.join("sandboxes")] {
            std::fs::create_dir_all(&d).ctx("mkdir", &d)?;
            // Root's alone: records, logs and the database hold tokens. Sandboxes reach
            // their own directories relative to a working directory the runtime gives
            // them, never through these.
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))
                .ctx("chmod", &d)?;
        }
        let templates = TemplateStore::open(&state_dir)?;
        let end = config
            .first_slot
            .saturating_add(config.max_sandboxes)
            .min(runtime.max_slots());
        let inner = Arc::new(Inner {
            templates,
            runtime,
            state: Mutex::new(State::new(
                UidSlots::new(config.uid_base, config.first_slot, end)
                    .with_quarantine(config.network.address_quarantine),
            )),
            changed: Arc::new(Notify::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
            dead: Mutex::new(VecDeque::new()),
            reconciled: Mutex::new(Default::default()),
            _node_lock: node_lock,
            _slot_lease: slot_lease,
            pool: crate::pool::Pool::new(&config),
            snapshots: crate::snapshot::SnapshotStore::open(&state_dir)?,
            on_checkpoint: std::sync::OnceLock::new(),
            object_store: std::sync::OnceLock::new(),
            published_copies: std::sync::OnceLock::new(),
            idle_conn_sweep: Mutex::new(None),
            arriving: Mutex::new(Default::default()),
            config,
        });
        let node = Node { inner };
        let report = crate::reconcile::reconcile(&node.inner).await?;
        *node
            .inner
            .reconciled
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = report;
        tokio::spawn(crate::reaper::run(Arc::downgrade(&node.inner)));
        if !node.inner.config.pool.is_empty() || node.inner.config.async_teardown {
            crate::pool::start_background(&node.inner);
        }
        Ok(node)
    }

    /// Stop this node's background work (reaper, exit watchers) and leave its sandboxes
    /// running: a later [`Node::open`] on the same state directory adopts them.
    pub fn close(&self) {
        self.inner
            .closed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let mut st = self.inner.lock();
        for live in st.live_unlisted().values_mut() {
            if let Some(w) = live.watcher.take() {
                w.abort();
            }
        }
        drop(st);
        self.inner.changed.notify_one();
        self.inner.pool.wake.notify_one();
        self.inner.pool.refilled.notify_waiters();
        // Unclaimed pooled sandboxes have no user: remove them rather than leave them.
        self.inner.drain_pool_blocking();
        // The egress layer (resolver, proxy) stops too; the next node re-registers the
        // sandboxes it adopts.
        self.inner.runtime.close();
    }

    /// What reconciliation adopted and removed when this node opened.
    pub fn reconcile_report(&self) -> crate::reconcile::ReconcileReport {
        self.inner
            .reconciled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The node's configuration.
    pub fn config(&self) -> &NodeConfig {
        &self.inner.config
    }

    /// The node's template store.
    pub fn templates(&self) -> &TemplateStore {
        &self.inner.templates
    }

    /// `<state>/sandboxes/<id>`.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.inner.sandbox_dir(id)
    }

    /// A client for the envd of sandbox `id` (with its access token).
    pub fn envd(&self, id: &str) -> Result<EnvdClient> {
        let st = self.inner.lock();
        let live = st
            .live()
            .get(id)
            .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
        Ok(EnvdClient::new(
            self.inner.envd_socket(id),
            Some(live.record.access_token.clone()),
        ))
    }

    /// Live sandboxes (creating, running or dying), sorted by creation time. Memory
    /// only, like [`Node::peek`]: `oom_kills` is 0 for each (reading every cgroup's
    /// counters cost a node with 6,000 sandboxes seconds per listing, contending with
    /// the creates' cgroup work); [`Node::get`] reads one sandbox's.
    pub fn list(&self) -> Vec<SandboxInfo> {
        let pooled = self.inner.pool.members();
        let st = self.inner.lock();
        let mut v: Vec<SandboxInfo> = st
            .live()
            .values()
            .filter(|l| !pooled.contains(&l.record.id))
            .map(|l| l.info(self.inner.envd_socket(&l.record.id)))
            .collect();
        drop(st);
        v.sort_by_key(|i| (i.created_at_ms, i.id.clone()));
        v
    }

    /// A number that grows with every change to what [`Node::list`] shows (read it
    /// before listing: a listing made after reading `v` shows every change counted up to
    /// `v`). Equal numbers mean equal listings, which a status poll need not build again.
    pub fn listing_version(&self) -> u64 {
        // Both only grow, so their sum does, and changes while the two are read count
        // in the next reading.
        self.inner.lock().version() + self.inner.pool.version()
    }

    /// The sandboxes whose PID 1 log (`init.log` in the sandbox directory) grew after
    /// `since`, and the mark to ask with next time; `None` when the runtime cannot tell.
    pub fn grown_logs(
        &self,
        since: Option<crate::init_log::LogMark>,
    ) -> Option<crate::init_log::GrownLogs> {
        self.inner.runtime.grown_logs(since)
    }

    /// A live sandbox, or a recently dead one (state `dead`, with its death reason).
    pub fn get(&self, id: &str) -> Result<SandboxInfo> {
        let mut info = self.peek(id)?;
        if info.state != SandboxState::Dead {
            self.inner.fill_counters(&mut info);
        }
        Ok(info)
    }

    /// [`Node::get`] without reading the live counters from the cgroup (`oom_kills` is 0
    /// for a sandbox that is not dead): memory only, for the request path.
    pub fn peek(&self, id: &str) -> Result<SandboxInfo> {
        if self.inner.pool.contains(id) {
            return Err(Error::SandboxNotFound(id.into()));
        }
        {
            let st = self.inner.lock();
            if let Some(l) = st.live().get(id) {
                return Ok(l.info(self.inner.envd_socket(id)));
            }
        }
        let dead = self.inner.dead.lock().unwrap_or_else(|p| p.into_inner());
        dead.iter()
            .rev()
            .find(|i| i.id == id)
            .cloned()
            .ok_or_else(|| Error::SandboxNotFound(id.into()))
    }

    /// Create a sandbox and return once its envd has accepted `/init`.
    ///
    /// Cancellation-safe: the work runs in its own task, so dropping this future (a client
    /// that went away) never strands a half-created sandbox; it completes and lives until
    /// its end time.
    pub async fn create(&self, req: CreateRequest) -> Result<SandboxInfo> {
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            let mut snap = inner.snapshots.find(&req.template).filter(|s| !s.hidden);
            if snap.is_none()
                && inner.object_store().is_some()
                && crate::template::validate_name(&req.template).is_ok()
                && inner.templates.get(&req.template)?.is_none()
            {
                // A snapshot taken on another node and published?
                snap = inner.pull_snapshot(&req.template).await?.map(|(s, _)| s);
            }
            if let Some(snap) = snap {
                let id = match &req.id {
                    Some(id) if let Ok(id) = SandboxId::parse(id) => id,
                    Some(id) => {
                        return Err(Error::InvalidRequest(format!(
                            "sandbox id '{id}' must match ^[a-z0-9]{{1,32}}$"
                        )));
                    }
                    None => crate::ids::new_sandbox_id(),
                };
                let timeout = req.timeout.unwrap_or(inner.config.default_timeout);
                return inner.create_from_snapshot(&req, &snap, id, timeout).await;
            }
            let plan = inner.plan_create(&req).await?;
            let pool_empty = match inner.try_claim(&req, &plan, false).await {
                Claim::Served(r) => return r,
                Claim::No => false,
                Claim::Empty => true,
            };
            // No sandbox of its template ready: a shell, if one is.
            if let Some(r) = inner.try_claim_shell(&req, &plan).await {
                return r;
            }
            let turn = if pool_empty {
                match inner.claim_or_turn(&req, &plan).await {
                    Ok(r) => return r,
                    Err(turn) => turn,
                }
            } else {
                None
            };
            inner.create_cold(&req, plan, t0, turn).await
        })
        .await
        .map_err(|e| Error::Runtime(format!("create task failed: {e}")))?
    }

    /// Create a sandbox of a template value that need not be in the store (a build step's
    /// sandbox: the layers built so far). Never claimed from a pool.
    pub async fn create_from(&self, template: Template, req: CreateRequest) -> Result<SandboxInfo> {
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let plan = inner.plan_with(&req, template)?;
            inner.create_cold(&req, plan, Instant::now(), None).await
        })
        .await
        .map_err(|e| Error::Runtime(format!("create task failed: {e}")))?
    }

    /// Pause a running sandbox: with `memory`, its processes and memory go to disk and
    /// come back on [`Node::resume`]; without, only its disk is kept and a resume boots
    /// its template again over it. A paused sandbox has no processes and uses no host
    /// memory; it keeps its id, slot (address, uid range) and token, and no end time
    /// applies to it. A failed pause leaves it running and says why.
    /// With an object store that publishes paused sandboxes, it is pushed before this
    /// returns (`handover.rs`), so that another node can take it over.
    pub async fn pause(&self, id: &str, req: PauseRequest) -> Result<PauseReport> {
        let (inner, i2) = (self.inner.clone(), id.to_string());
        let report = tokio::spawn(async move { inner.pause(&i2, req).await })
            .await
            .map_err(|e| Error::Runtime(format!("pause task failed: {e}")))??;
        self.publish_after_pause(id).await;
        Ok(report)
    }

    /// Resume a paused sandbox with end time now + `timeout` (`memory: false` boots it
    /// from its disk even if its memory was kept). A running one only gets its end time
    /// extended (never shortened). A failed resume leaves it paused and says why.
    /// A sandbox this node published that moved to another node since is refused (and
    /// released here: `handover.rs`); so is one the cluster's database no longer counts as
    /// this node's ([`PublishedCopies::resuming`]).
    pub async fn resume(&self, id: &str, timeout: Duration, memory: bool) -> Result<ResumeOutcome> {
        self.check_still_owner(id).await?;
        if self.peek(id).is_ok_and(|i| i.state == SandboxState::Paused) {
            self.resuming_published(id).await?;
            self.forget_published(id);
        }
        self.resume_here(id, timeout, memory).await
    }

    /// [`Node::resume`] without the owner check.
    pub(crate) async fn resume_here(
        &self,
        id: &str,
        timeout: Duration,
        memory: bool,
    ) -> Result<ResumeOutcome> {
        let (inner, i2) = (self.inner.clone(), id.to_string());
        tokio::spawn(async move { inner.resume(&i2, timeout, memory).await })
            .await
            .map_err(|e| Error::Runtime(format!("resume task failed: {e}")))?
    }

    /// Snapshot a running sandbox (it is stopped only while its state is captured): a
    /// template other sandboxes can be created from, and a point to roll it back to.
    pub async fn snapshot(&self, id: &str, req: SnapshotRequest) -> Result<SnapshotReport> {
        let (inner, id) = (self.inner.clone(), id.to_string());
        tokio::spawn(async move { inner.snapshot(&id, req, false).await })
            .await
            .map_err(|e| Error::Runtime(format!("snapshot task failed: {e}")))?
    }

    /// `count` new sandboxes, each with the source's memory and disk at this moment, their
    /// own ids, tokens, addresses and end time now + `timeout`; the source runs on. One
    /// result per fork, in order.
    pub async fn fork(
        &self,
        id: &str,
        count: usize,
        timeout: Duration,
    ) -> Result<Vec<Result<SandboxInfo>>> {
        let (inner, id) = (self.inner.clone(), id.to_string());
        tokio::spawn(async move { inner.fork(&id, count, timeout).await })
            .await
            .map_err(|e| Error::Runtime(format!("fork task failed: {e}")))?
    }

    /// Put a sandbox (running or paused) back to one of its snapshots, in place: same id,
    /// slot, address and token; processes, memory and disk as at the snapshot. Returns how
    /// long it took.
    pub async fn rollback(&self, id: &str, snapshot: &str) -> Result<Duration> {
        let (inner, id, snap) = (self.inner.clone(), id.to_string(), snapshot.to_string());
        tokio::spawn(async move { inner.rollback(&id, &snap).await })
            .await
            .map_err(|e| Error::Runtime(format!("rollback task failed: {e}")))?
    }

    /// Every visible snapshot, oldest first.
    pub fn snapshots(&self) -> Vec<crate::SnapshotRecord> {
        self.inner
            .snapshots
            .list()
            .into_iter()
            .filter(|s| !s.hidden)
            .collect()
    }

    /// The snapshot `name` refers to (its id, `id:default` or one of its names).
    pub fn find_snapshot(&self, name: &str) -> Option<crate::SnapshotRecord> {
        self.inner.snapshots.find(name).filter(|s| !s.hidden)
    }

    /// Delete a snapshot (refused while a sandbox is being made from it... which only
    /// reads it at start: sandboxes made from it keep running).
    pub async fn delete_snapshot(&self, id: &str) -> Result<()> {
        let (inner, id) = (self.inner.clone(), id.to_string());
        tokio::spawn(async move { inner.delete_snapshot(&id).await })
            .await
            .map_err(|e| Error::Runtime(format!("snapshot task failed: {e}")))?
    }

    /// Sets the function called with a sandbox's id just before its processes are
    /// checkpointed or stopped (pause, snapshot, fork, rollback, also an automatic pause),
    /// after the sandbox stopped being routable: the data plane closes its connections to
    /// it there (a connection from outside cannot be checkpointed). Only the first call
    /// takes effect.
    pub fn on_checkpoint(&self, hook: Box<dyn Fn(&str) + Send + Sync>) {
        let _ = self.inner.on_checkpoint.set(hook);
    }

    /// The idle connection to running sandbox `id`'s envd that its create left open, for
    /// the data plane's first request to it (`idle_conn.rs`); `None` when there is none
    /// (taken, expired, or the sandbox is pooled, busy or not running).
    pub fn take_envd_conn(&self, id: &str) -> Option<crate::envd_client::IdleConn> {
        {
            let st = self.inner.lock();
            let live = st.live().get(id)?;
            if live.record.state != SandboxState::Running || live.busy.is_some() {
                return None;
            }
        }
        if self.inner.pool.contains(id) {
            return None;
        }
        self.inner
            .take_envd_conn(id)
            .filter(crate::envd_client::is_idle_open)
    }

    /// Whether this node can pause, snapshot and fork (and if not, why).
    pub fn checkpoint_support(&self) -> std::result::Result<(), String> {
        self.inner.runtime.checkpoint_support()
    }

    /// Kill a sandbox (reason `killed`) and remove every trace of it. Returns when it is
    /// gone (for a sandbox still being created: once the kill is registered; its `create`
    /// then fails and cleans up).
    pub async fn kill(&self, id: &str) -> Result<()> {
        self.kill_with_reason(id, DeathReason::Killed).await
    }

    /// Kill with an explicit reason.
    pub async fn kill_with_reason(&self, id: &str, reason: DeathReason) -> Result<()> {
        // A pause, resume, snapshot or rollback under way (e.g. an auto-pause at the end
        // time) finishes first: a kill is never refused for it, only delayed.
        let t0 = Instant::now();
        loop {
            {
                let mut st = self.inner.lock();
                let live = st
                    .live_mut()
                    .get_mut(id)
                    .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
                if live.record.state == SandboxState::Creating {
                    // create() notices and tears down itself.
                    live.kill_requested = Some(reason);
                    return Ok(());
                }
                match live.busy {
                    None => break,
                    Some(b) if t0.elapsed() >= KILL_WAITS_FOR_BUSY => {
                        return Err(Error::Conflict(format!(
                            "sandbox '{id}' is still {} after {} s; kill it afterwards",
                            b.as_str(),
                            KILL_WAITS_FOR_BUSY.as_secs()
                        )));
                    }
                    Some(_) => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if self.inner.config.async_teardown {
            // Dead now, cleaned up in the background: mark it (state `dying`, reason),
            // SIGKILL its init (the sandbox's pid namespace dies with it), answer.
            let Some(record) = self.inner.mark_dying(id, reason, false) else {
                return Err(Error::SandboxNotFound(id.into()));
            };
            // Its network namespace held first: the teardown can then tell whether it
            // ever sent a packet (its interface would die with it), and skips the
            // conntrack walk if not.
            self.inner.runtime.hold_network(id, record.slot);
            // The pidfd pins the process: then check it is still the recorded one.
            if let Some(pid) = record.pid.filter(|p| *p > 1)
                && let Ok(fd) = cubicle_syscalls::pidfd::pidfd_open(pid)
                && procfs::is_alive(pid, record.pid_start_time)
            {
                let _ = cubicle_syscalls::pidfd::pidfd_kill(&fd);
            }
            let (inner, id2) = (self.inner.clone(), id.to_string());
            use std::sync::atomic::Ordering::SeqCst;
            inner.pool.teardowns.fetch_add(1, SeqCst);
            let work = async move {
                let limit = inner.config.teardown_yield;
                inner.pool.yield_to_refill(limit, &inner.closed).await;
                let permit = inner.pool.teardown_permits.acquire().await;
                inner.clone().teardown(&id2, record).await;
                drop(permit);
                inner.pool.teardowns.fetch_sub(1, SeqCst);
            };
            // On the low-priority background thread: cleaning up after a sandbox must
            // not slow the requests and sandboxes still in use.
            match self.inner.pool.background.get() {
                Some(bg) => drop(bg.spawn(work)),
                None => drop(tokio::spawn(work)),
            }
            return Ok(());
        }
        // In its own task: a dropped caller must not stop a teardown halfway.
        let (inner, id2) = (self.inner.clone(), id.to_string());
        let done = tokio::spawn(async move { inner.finish(&id2, reason, false).await })
            .await
            .map_err(|e| Error::Runtime(format!("kill task failed: {e}")))?;
        if done {
            Ok(())
        } else {
            Err(Error::SandboxNotFound(id.into()))
        }
    }

    /// Kill every live sandbox (reason `killed`).
    pub async fn kill_all(&self) {
        let ids: Vec<SandboxId> = self.inner.lock().live().keys().cloned().collect();
        for id in ids {
            let _ = self.kill(&id).await;
        }
    }

    /// Set a sandbox's end time to now + `timeout`.
    pub fn set_timeout(&self, id: &str, timeout: Duration) -> Result<()> {
        let record = {
            let mut st = self.inner.lock();
            let live = st
                .live_mut()
                .get_mut(id)
                .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
            live.record.end_at_ms = now_ms() + timeout.as_millis() as u64;
            live.record.clone()
        };
        fsutil::rewrite_json(&self.inner.sandbox_dir(id).join("sandbox.json"), &record)?;
        self.inner.changed.notify_one();
        Ok(())
    }

    /// Usage counters of a live sandbox (memory, OOM kills so far, CPU, tasks, disk).
    pub fn stats(&self, id: &str) -> Result<crate::runtime::SandboxStats> {
        if !self.inner.lock().live().contains_key(id) {
            return Err(Error::SandboxNotFound(id.into()));
        }
        self.inner
            .runtime
            .stats(id)
            .ok_or_else(|| Error::SandboxNotFound(id.into()))
    }

    /// Pool counters.
    pub fn pool_stats(&self) -> PoolStats {
        self.inner.pool.stats()
    }

    /// Waits (up to `limit`) until background teardowns of killed sandboxes are done;
    /// a server calls it before [`Node::close`] so that a stop leaves nothing half-removed.
    /// Returns how many are still queued (0 when all are done).
    pub async fn settle(&self, limit: Duration) -> usize {
        let t = Instant::now();
        loop {
            let left = self
                .inner
                .pool
                .teardowns
                .load(std::sync::atomic::Ordering::SeqCst);
            if left == 0 || t.elapsed() >= limit {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// After [`Node::close`]: waits (up to `limit`) until a pool refill under way has
    /// removed the sandbox it was making (one of a template with a start command takes
    /// seconds to make), so that a stopping server leaves nothing running.
    pub async fn wait_refills(&self, limit: Duration) {
        let t = Instant::now();
        while !self.inner.pool.members().is_empty() && t.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// How a process that ran this node ends with it: background teardowns finished (up
    /// to a minute: a bench's 3,000 kills took about 27 s, and with 10 s a third of them
    /// were left for the next start), [`Node::close`], a refill under way finished (up
    /// to 25 s; both within systemd's 90 s for the unit), then the quota filesystem
    /// released if no sandbox is left ([`Node::release_storage`]). Running sandboxes
    /// keep running: the next open adopts them.
    pub async fn stop(&self) {
        let left = self.settle(Duration::from_secs(60)).await;
        if left > 0 {
            tracing::warn!(
                teardowns = left,
                "stopping with sandbox teardowns still queued; the next start finishes them"
            );
        }
        self.close();
        self.wait_refills(Duration::from_secs(25)).await;
        self.release_storage().await;
    }

    /// After [`Node::close`] and [`Node::wait_refills`]: when no sandbox runs any more
    /// (none adopted or left running for the next start, no teardown or refill under
    /// way), unmounts the sandboxes' quota filesystem, so that a stopped server leaves
    /// no mount behind; paused sandboxes and snapshots stay in its image. With sandboxes
    /// still running it stays: they live on it, and the next start adopts them.
    pub async fn release_storage(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let idle = self.inner.closed.load(SeqCst)
            && self.inner.lock().live().is_empty()
            && self.inner.pool.members().is_empty()
            && self.inner.pool.teardowns.load(SeqCst) == 0;
        if idle {
            let inner = self.inner.clone();
            let _ = tokio::task::spawn_blocking(move || inner.runtime.release_storage()).await;
        }
    }

    /// Host memory used by a sandbox's cgroup, in bytes.
    pub fn memory_usage(&self, id: &str) -> Option<u64> {
        self.inner.runtime.memory_usage(id)
    }
}

/// Ids of sandboxes whose records name `template`, then its snapshots (`snapshot <id>`):
/// what keeps it from being removed (a paused sandbox or a snapshot restores onto it).
pub fn sandboxes_using_template(state_dir: &Path, template: &str) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(state_dir.join("sandboxes")) else {
        return out;
    };
    for e in rd.flatten() {
        // Only sandbox directories (a snapshot holds a copy of its source's record).
        if !SandboxId::is_valid(&e.file_name().to_string_lossy()) {
            continue;
        }
        if let Ok(r) = fsutil::read_json::<SandboxRecord>(&e.path().join("sandbox.json"))
            && r.rootfs_template() == template
        {
            out.push(r.id.into());
        }
    }
    if state_dir.join("snapshots").is_dir()
        && let Ok(snaps) = crate::snapshot::SnapshotStore::open(state_dir)
    {
        out.extend(
            snaps
                .list()
                .into_iter()
                .filter(|s| s.base_template == template)
                .map(|s| format!("snapshot {}", s.id)),
        );
    }
    out
}

/// Layer ids the sandboxes and snapshots on disk use (what `cubicle template gc` keeps
/// without a running node).
pub fn layers_in_use_on_disk(state_dir: &Path) -> std::collections::HashSet<String> {
    let mut used: std::collections::HashSet<String> = records_on_disk(state_dir)
        .into_iter()
        .flat_map(|r| r.layers)
        .collect();
    if state_dir.join("snapshots").is_dir()
        && let Ok(snaps) = crate::snapshot::SnapshotStore::open(state_dir)
    {
        used.extend(snaps.list().into_iter().flat_map(|s| s.layers));
    }
    used
}

/// Records on disk (for `cubicle sandbox list` without a running node).
pub fn records_on_disk(state_dir: &Path) -> Vec<SandboxRecord> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(state_dir.join("sandboxes")) else {
        return out;
    };
    for e in rd.flatten() {
        if !SandboxId::is_valid(&e.file_name().to_string_lossy()) {
            continue;
        }
        if let Ok(r) = fsutil::read_json::<SandboxRecord>(&e.path().join("sandbox.json")) {
            out.push(r);
        }
    }
    out.sort_by_key(|r| r.created_at_ms);
    out
}

#[cfg(test)]
mod tests;
