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

use std::collections::{HashMap, VecDeque};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::config::NodeConfig;
use crate::envd_client::{EnvdClient, InitRequest};
use crate::error::{Error, IoContext, Result};
use crate::runtime::{SandboxRuntime, StartSpec};
use crate::sandbox::{CreateRequest, DeathReason, SandboxInfo, SandboxRecord, SandboxState};
use crate::slots::{IDS_PER_SANDBOX, UidSlots};
use crate::template::{Template, TemplateStore};
use crate::{fsutil, ids, procfs};

/// Path of envd inside the sandbox.
pub const ENVD_IN_SANDBOX: &str = "/run/cubicle/envd";
/// envd's socket inside the sandbox (host side: `<sandbox dir>/ctl/envd.sock`).
pub const ENVD_SOCKET_IN_SANDBOX: &str = "/run/cubicle/ctl/envd.sock";
/// How many dead sandboxes `get` still remembers (with their death reason).
const DEAD_MEMORY: usize = 1024;

/// The sandboxes of one host. Cheap to clone.
#[derive(Clone)]
pub struct Node {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) config: NodeConfig,
    pub(crate) templates: TemplateStore,
    pub(crate) runtime: Arc<dyn SandboxRuntime>,
    pub(crate) state: Mutex<State>,
    /// Woken when end times change (the reaper re-plans) or the node closes.
    pub(crate) changed: Arc<Notify>,
    /// Set by [`Node::close`]: the reaper stops.
    pub(crate) closed: std::sync::atomic::AtomicBool,
    /// Recently dead sandboxes, newest last.
    pub(crate) dead: Mutex<VecDeque<SandboxInfo>>,
    /// What reconciliation did when the node opened.
    pub(crate) reconciled: Mutex<crate::reconcile::ReconcileReport>,
    /// Exclusive lock on `<state>/node.lock`: one node per state directory.
    _node_lock: std::fs::File,
    /// Warm pools and the cold-create semaphore (`pool.rs`).
    pub(crate) pool: crate::pool::Pool,
}

pub(crate) struct State {
    pub(crate) live: HashMap<String, Live>,
    pub(crate) slots: UidSlots,
}

pub(crate) struct Live {
    pub(crate) record: SandboxRecord,
    pub(crate) ready_us: u64,
    /// `kill` arrived while the sandbox was still being created.
    pub(crate) kill_requested: Option<DeathReason>,
    /// Teardown failed; the reaper retries it.
    pub(crate) teardown_failed: bool,
    pub(crate) watcher: Option<tokio::task::AbortHandle>,
}

impl Live {
    /// A sandbox that is being created (or adopted): no kill pending, no watcher yet.
    pub(crate) fn new(record: SandboxRecord) -> Self {
        Live {
            record,
            ready_us: 0,
            kill_requested: None,
            teardown_failed: false,
            watcher: None,
        }
    }
}

impl Node {
    /// Open the node on `config.state_dir` with the given runtime: create the state
    /// layout, reconcile whatever a previous run left (adopt live sandboxes it knows,
    /// remove everything else), and start the reaper that enforces end times.
    pub async fn open_with_runtime(
        config: NodeConfig,
        runtime: Arc<dyn SandboxRuntime>,
    ) -> Result<Node> {
        let lock = Node::lock_state_dir(&config.state_dir).await?;
        Node::open_locked(config, runtime, lock).await
    }

    /// Take the state directory's node lock (one node per state directory); waits while
    /// another process holds it.
    pub(crate) async fn lock_state_dir(state_dir: &Path) -> Result<std::fs::File> {
        std::fs::create_dir_all(state_dir).ctx("mkdir", state_dir)?;
        let p = state_dir.join("node.lock");
        blocking(move || lock_node(&p)).await
    }

    pub(crate) async fn open_locked(
        config: NodeConfig,
        runtime: Arc<dyn SandboxRuntime>,
        node_lock: std::fs::File,
    ) -> Result<Node> {
        let state_dir = config.state_dir.clone();
        for d in [state_dir.clone(), state_dir.join("sandboxes")] {
            std::fs::create_dir_all(&d).ctx("mkdir", &d)?;
            // The sandbox's root (an unprivileged host uid) must traverse these to reach
            // its overlay upper/work dirs.
            let mode = std::fs::metadata(&d).ctx("stat", &d)?.permissions().mode();
            if mode & 0o001 == 0 {
                std::fs::set_permissions(
                    &d,
                    std::fs::Permissions::from_mode((mode & 0o7777) | 0o711),
                )
                .ctx("chmod", &d)?;
            }
        }
        let templates = TemplateStore::open(&state_dir)?;
        let end = config
            .first_slot
            .saturating_add(config.max_sandboxes)
            .min(runtime.max_slots());
        let inner = Arc::new(Inner {
            templates,
            runtime,
            state: Mutex::new(State {
                live: HashMap::new(),
                slots: UidSlots::new(config.uid_base, config.first_slot, end),
            }),
            changed: Arc::new(Notify::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
            dead: Mutex::new(VecDeque::new()),
            reconciled: Mutex::new(Default::default()),
            _node_lock: node_lock,
            pool: crate::pool::Pool::new(&config),
            config,
        });
        let node = Node { inner };
        let report = crate::reconcile::reconcile(&node).await?;
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
        for live in st.live.values_mut() {
            if let Some(w) = live.watcher.take() {
                w.abort();
            }
        }
        drop(st);
        self.inner.changed.notify_one();
        self.inner.pool.wake.notify_one();
        // Unclaimed pooled sandboxes have no user: remove them rather than leave them.
        self.drain_pool_blocking();
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
            .live
            .get(id)
            .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
        Ok(EnvdClient::new(
            self.inner.envd_socket(id),
            Some(live.record.access_token.clone()),
        ))
    }

    /// Live sandboxes (creating, running or dying), sorted by creation time.
    pub fn list(&self) -> Vec<SandboxInfo> {
        let pooled = self.inner.pool.members();
        let st = self.inner.lock();
        let mut v: Vec<SandboxInfo> = st
            .live
            .values()
            .filter(|l| !pooled.contains(&l.record.id))
            .map(|l| {
                SandboxInfo::from_record(
                    &l.record,
                    self.inner.envd_socket(&l.record.id),
                    l.ready_us,
                )
            })
            .collect();
        drop(st);
        for i in &mut v {
            self.inner.fill_counters(i);
        }
        v.sort_by_key(|i| (i.created_at_ms, i.id.clone()));
        v
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
            if let Some(l) = st.live.get(id) {
                return Ok(SandboxInfo::from_record(
                    &l.record,
                    self.inner.envd_socket(id),
                    l.ready_us,
                ));
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
        let node = self.clone();
        tokio::spawn(async move { node.create_inner(req).await })
            .await
            .map_err(|e| Error::Runtime(format!("create task failed: {e}")))?
    }

    async fn create_inner(&self, req: CreateRequest) -> Result<SandboxInfo> {
        let t0 = Instant::now();
        let inner = &self.inner;
        // A built template is one small file read, done inline; building one (a first
        // use of a built-in) goes to the blocking pool.
        let template = match inner.templates.get(&req.template)? {
            Some(t) => t,
            None => {
                let store = inner.templates.clone();
                let name = req.template.clone();
                let progress = inner.config.template_progress;
                tokio::task::spawn_blocking(move || store.ensure(&name, progress))
                    .await
                    .map_err(|e| Error::Runtime(format!("template task: {e}")))??
            }
        };
        let id = match &req.id {
            Some(id) if ids::is_valid_sandbox_id(id) => id.clone(),
            Some(id) => {
                return Err(Error::InvalidRequest(format!(
                    "sandbox id '{id}' must match ^[a-z0-9]{{1,32}}$"
                )));
            }
            None => ids::new_sandbox_id(),
        };
        let memory_mb = req.memory_mb.unwrap_or(template.config.memory_mb);
        let cpus = req.cpus.unwrap_or(template.config.cpus);
        let disk_mb = req.disk_mb.unwrap_or(template.config.disk_mb);
        if !(16..=1 << 20).contains(&memory_mb) {
            return Err(Error::InvalidRequest(format!(
                "memory_mb {memory_mb} must be between 16 and 1048576"
            )));
        }
        if !(1..=256).contains(&cpus) {
            return Err(Error::InvalidRequest(format!(
                "cpus {cpus} must be between 1 and 256"
            )));
        }
        if !(16..=1 << 24).contains(&disk_mb) {
            return Err(Error::InvalidRequest(format!(
                "disk_mb {disk_mb} must be between 16 and 16777216"
            )));
        }
        let timeout = req.timeout.unwrap_or(inner.config.default_timeout);
        if let Some(r) = self
            .try_claim(&req, &template, (memory_mb, cpus, disk_mb), timeout)
            .await
        {
            return r;
        }
        // Cold: bounded concurrency (fair FIFO semaphore), shared with pool refills.
        let _permit = inner.pool.create_permits.clone().acquire_owned().await.ok();
        let env_vars = sandbox_env(&template, &req.env_vars, &id);
        let record = inner.reserve(&id, &template, |r| {
            r.end_at_ms = r.created_at_ms + timeout.as_millis() as u64;
            (r.memory_mb, r.cpus, r.disk_mb) = (memory_mb, cpus, disk_mb);
            r.internet = req.internet;
            r.env_vars = env_vars;
            r.metadata = req.metadata.clone();
        })?;

        match self.bring_up(record, &template, t0).await {
            Ok(info) => Ok(info),
            Err(e) => {
                tracing::warn!(sandbox = %id, "create failed: {e}");
                let reason = {
                    let st = inner.lock();
                    st.live.get(&id).and_then(|l| l.kill_requested)
                };
                inner
                    .clone()
                    .finish(&id, reason.unwrap_or(DeathReason::Exited), true)
                    .await;
                Err(e)
            }
        }
    }

    async fn bring_up(
        &self,
        record: SandboxRecord,
        template: &Template,
        t0: Instant,
    ) -> Result<SandboxInfo> {
        let inner = &self.inner;
        let id = record.id.clone();
        let dir = inner.sandbox_dir(&id);
        let (record, started, [t_prep, t_spawn, t_health]) =
            self.start_sandbox(record, template, t0).await?;
        let pid = started.pid;
        self.init_sandbox(
            record, template, t0, started, pid, &id, &dir, t_prep, t_spawn, t_health,
        )
        .await
    }

    /// First half of a create (also a pool refill): directory, quota, spawn, envd healthy.
    pub(crate) async fn start_phase(
        &self,
        record: SandboxRecord,
        template: &Template,
        t0: Instant,
    ) -> Result<SandboxRecord> {
        Ok(self.start_sandbox(record, template, t0).await?.0)
    }

    async fn start_sandbox(
        &self,
        mut record: SandboxRecord,
        template: &Template,
        t0: Instant,
    ) -> Result<(SandboxRecord, crate::runtime::Started, [Duration; 3])> {
        let inner = &self.inner;
        let id = record.id.clone();
        let dir = inner.sandbox_dir(&id);
        if dir.exists() {
            // A leftover with the same id (cannot be live: the id was free). Remove it.
            let rt = inner.runtime.clone();
            let (i2, d2) = (id.clone(), dir.clone());
            blocking(move || {
                rt.destroy(&i2, None, &d2)?;
                rt.remove_dir(&i2, &d2)
            })
            .await?;
        }
        let rt = inner.runtime.clone();
        let (i2, d2, disk_mb) = (id.clone(), dir.clone(), record.disk_mb);
        blocking(move || rt.create_dir(&i2, &d2, disk_mb)).await?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))
            .ctx("chmod", &dir)?;
        let ctl = dir.join("ctl");
        std::fs::create_dir_all(&ctl).ctx("mkdir", &ctl)?;
        give_to_sandbox_root(&ctl, record.uid_base)?;
        std::fs::set_permissions(&ctl, std::fs::Permissions::from_mode(0o700))
            .ctx("chmod", &ctl)?;
        fsutil::write_json_atomic(&dir.join("sandbox.json"), &record)?;
        let mut binds = write_etc_files(&dir, &id, record.uid_base)?;
        binds.extend(crate::template::code_interpreter::bind_for(
            &template.config,
        ));

        let spec = StartSpec {
            id: id.clone(),
            rootfs: template.rootfs.clone(),
            sandbox_dir: dir.clone(),
            slot: record.slot,
            uid_base: record.uid_base,
            uid_count: IDS_PER_SANDBOX,
            memory_mb: record.memory_mb,
            cpus: record.cpus,
            pids: inner.config.pids_limit,
            disk_mb: record.disk_mb,
            internet: record.internet,
            hostname: id.clone(),
            envd_binary: inner.config.envd_binary.clone(),
            init: vec![
                ENVD_IN_SANDBOX.into(),
                "--init".into(),
                "--unix-socket".into(),
                ENVD_SOCKET_IN_SANDBOX.into(),
                "--default-user".into(),
                record.default_user.clone(),
                "--default-workdir".into(),
                record.default_workdir.clone(),
            ],
            env: template.config.env.clone(),
            binds,
        };
        let t_prep = t0.elapsed();
        let rt = inner.runtime.clone();
        let started = blocking(move || rt.start(&spec)).await?;
        let t_spawn = t0.elapsed();
        record.pid = Some(started.pid);
        record.pid_start_time = procfs::start_time(started.pid);
        record.runtime = started.state.clone();
        fsutil::write_json_atomic(&dir.join("sandbox.json"), &record)?;
        self.update_record(&record)?;

        let client = EnvdClient::new(inner.envd_socket(&id), None);
        let (pid, pst) = (started.pid, record.pid_start_time);
        client
            .wait_ready(inner.config.envd_ready_timeout, move || {
                procfs::is_alive(pid, pst)
            })
            .await?;
        let t_health = t0.elapsed();
        Ok((record, started, [t_prep, t_spawn, t_health]))
    }

    /// Second half of a cold create: `/init`, start command, readiness, `running`.
    #[allow(clippy::too_many_arguments)]
    async fn init_sandbox(
        &self,
        mut record: SandboxRecord,
        template: &Template,
        t0: Instant,
        started: crate::runtime::Started,
        pid: i32,
        id: &str,
        dir: &Path,
        t_prep: Duration,
        t_spawn: Duration,
        t_health: Duration,
    ) -> Result<SandboxInfo> {
        let inner = &self.inner;
        let id = id.to_string();
        let client = EnvdClient::new(inner.envd_socket(&id), None);
        client.init(&InitRequest::for_record(&record)).await?;
        let mut start_command = None;
        if let Some(cmd) = template
            .config
            .start_command
            .as_deref()
            .filter(|c| !c.trim().is_empty())
        {
            // The template's start command: started through envd as the default user, in
            // the background (its failure to start fails the create).
            let authed = EnvdClient::new(inner.envd_socket(&id), Some(record.access_token.clone()));
            let spec = crate::envd_client::ProcessSpec {
                cmd: "/bin/sh".into(),
                args: vec!["-c".into(), cmd.to_string()],
                ..Default::default()
            };
            // Its output is kept (the last 4 KiB) until the sandbox is ready, so that a
            // start command that fails or never listens explains itself in the error.
            let watched = authed.start_watched(&spec, 4096).await?;
            tracing::info!(sandbox = %id, pid = watched.pid, "start command running: {cmd}");
            start_command = Some(watched);
        }
        if let Some(port) = template.config.ready_port {
            // The template's readiness probe (e.g. code-interpreter's /health on 49999).
            let (spid, pst) = (started.pid, record.pid_start_time);
            let exit_code = start_command.as_ref().map(|w| w.exit_code());
            let r = blocking(move || {
                crate::template::ready::wait_http_health(
                    spid,
                    port,
                    std::time::Duration::from_secs(120),
                    move || {
                        if !procfs::is_alive(spid, pst) {
                            return Some("the sandbox died".into());
                        }
                        // A start command that exits 0 may have left a server running in
                        // the background: only a failure ends the wait early.
                        let failed = exit_code.as_ref().and_then(|f| f()).filter(|c| *c != 0);
                        failed.map(|code| format!("the start command failed (exit code {code})"))
                    },
                )
            })
            .await;
            if let (Err(e), Some(w)) = (&r, &start_command) {
                return Err(Error::Runtime(format!(
                    "{e}; the start command: {}",
                    w.describe()
                )));
            }
            r?;
        }
        drop(start_command);
        record.state = SandboxState::Running;
        fsutil::write_json_atomic(&dir.join("sandbox.json"), &record)?;
        let ready_us = t0.elapsed().as_micros() as u64;
        {
            let mut st = inner.lock();
            let live = st
                .live
                .get_mut(&id)
                .ok_or_else(|| Error::SandboxNotFound(id.clone()))?;
            if let Some(reason) = live.kill_requested {
                return Err(Error::Runtime(format!(
                    "sandbox {id} was killed during creation ({reason})"
                )));
            }
            live.record = record.clone();
            live.ready_us = ready_us;
            live.watcher = Some(spawn_watcher(Arc::downgrade(inner), id.clone(), pid));
        }
        inner.changed.notify_one();
        tracing::info!(
            sandbox = %id,
            template = %record.template,
            ready_us,
            prepared_us = t_prep.as_micros() as u64,
            spawned_us = t_spawn.as_micros() as u64,
            healthy_us = t_health.as_micros() as u64,
            "sandbox ready"
        );
        Ok(SandboxInfo::from_record(
            &record,
            inner.envd_socket(&id),
            ready_us,
        ))
    }

    fn update_record(&self, record: &SandboxRecord) -> Result<()> {
        let mut st = self.inner.lock();
        let live = st
            .live
            .get_mut(&record.id)
            .ok_or_else(|| Error::SandboxNotFound(record.id.clone()))?;
        if let Some(reason) = live.kill_requested {
            return Err(Error::Runtime(format!(
                "sandbox {} was killed during creation ({reason})",
                record.id
            )));
        }
        live.record = record.clone();
        Ok(())
    }

    /// Kill a sandbox (reason `killed`) and remove every trace of it. Returns when it is
    /// gone (for a sandbox still being created: once the kill is registered; its `create`
    /// then fails and cleans up).
    pub async fn kill(&self, id: &str) -> Result<()> {
        self.kill_with_reason(id, DeathReason::Killed).await
    }

    /// Kill with an explicit reason.
    pub async fn kill_with_reason(&self, id: &str, reason: DeathReason) -> Result<()> {
        {
            let mut st = self.inner.lock();
            let live = st
                .live
                .get_mut(id)
                .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
            if live.record.state == SandboxState::Creating {
                // create() notices and tears down itself.
                live.kill_requested = Some(reason);
                return Ok(());
            }
        }
        if self.inner.config.async_teardown {
            // Dead now, cleaned up in the background: mark it (state `dying`, reason),
            // SIGKILL its init (the sandbox's pid namespace dies with it), answer.
            let Some(record) = self.inner.mark_dying(id, reason, false) else {
                return Err(Error::SandboxNotFound(id.into()));
            };
            // The pidfd pins the process: then check it is still the recorded one.
            if let Some(pid) = record.pid.filter(|p| *p > 1)
                && let Ok(fd) = procfs::pidfd_open(pid)
                && procfs::is_alive(pid, record.pid_start_time)
            {
                use std::os::fd::AsRawFd;
                // SAFETY: pidfd_send_signal on a pidfd we own; no pointers but NULL.
                unsafe {
                    libc::syscall(
                        libc::SYS_pidfd_send_signal,
                        fd.as_raw_fd(),
                        libc::SIGKILL,
                        std::ptr::null::<libc::siginfo_t>(),
                        0,
                    )
                };
            }
            let (inner, id2) = (self.inner.clone(), id.to_string());
            use std::sync::atomic::Ordering::SeqCst;
            inner.pool.teardowns.fetch_add(1, SeqCst);
            let work = async move {
                inner.clone().teardown(&id2, record).await;
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
        let ids: Vec<String> = self.inner.lock().live.keys().cloned().collect();
        for id in ids {
            let _ = self.kill(&id).await;
        }
    }

    /// Set a sandbox's end time to now + `timeout`.
    pub fn set_timeout(&self, id: &str, timeout: Duration) -> Result<()> {
        let record = {
            let mut st = self.inner.lock();
            let live = st
                .live
                .get_mut(id)
                .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
            live.record.end_at_ms = now_ms() + timeout.as_millis() as u64;
            live.record.clone()
        };
        fsutil::write_json_atomic(&self.inner.sandbox_dir(id).join("sandbox.json"), &record)?;
        self.inner.changed.notify_one();
        Ok(())
    }

    /// Usage counters of a live sandbox (memory, OOM kills so far, CPU, tasks, disk).
    pub fn stats(&self, id: &str) -> Result<crate::runtime::SandboxStats> {
        if !self.inner.lock().live.contains_key(id) {
            return Err(Error::SandboxNotFound(id.into()));
        }
        self.inner
            .runtime
            .stats(id)
            .ok_or_else(|| Error::SandboxNotFound(id.into()))
    }

    /// Host memory used by a sandbox's cgroup, in bytes.
    pub fn memory_usage(&self, id: &str) -> Option<u64> {
        self.inner.runtime.memory_usage(id)
    }
}

impl Inner {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.config.state_dir.join("sandboxes").join(id)
    }

    pub(crate) fn envd_socket(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("ctl").join("envd.sock")
    }

    /// Live counters of a live sandbox's info (OOM kills so far).
    pub(crate) fn fill_counters(&self, info: &mut SandboxInfo) {
        if let Some(s) = self.runtime.stats(&info.id) {
            info.oom_kills = s.oom_kills;
        }
    }

    /// Tear sandbox `id` down for `reason`: record why, destroy its kernel objects,
    /// remove its directory, free its slot. Returns false if someone else is already
    /// doing it or it is unknown. `from_create` allows tearing down a `creating` one.
    pub(crate) async fn finish(
        self: Arc<Self>,
        id: &str,
        reason: DeathReason,
        from_create: bool,
    ) -> bool {
        let Some(record) = self.mark_dying(id, reason, from_create) else {
            return false;
        };
        self.teardown(id, record).await
    }

    /// First step of [`Inner::finish`]: record the death (state `dying`, reason), stop
    /// watching. `None`: unknown, or someone else is already tearing it down.
    pub(crate) fn mark_dying(
        &self,
        id: &str,
        reason: DeathReason,
        from_create: bool,
    ) -> Option<SandboxRecord> {
        {
            let mut st = self.lock();
            let live = st.live.get_mut(id)?;
            let retry = live.teardown_failed;
            if !retry {
                if live.record.state == SandboxState::Dying
                    || (live.record.state == SandboxState::Creating && !from_create)
                {
                    return None;
                }
                live.record.state = SandboxState::Dying;
                // A limit hit explains an `exited` better than the plain word.
                live.record.death_reason = Some(reason);
            }
            live.teardown_failed = false;
            if let Some(w) = live.watcher.take() {
                w.abort();
            }
            Some(live.record.clone())
        }
    }

    /// Second step of [`Inner::finish`]: destroy, remove, free the slot.
    pub(crate) async fn teardown(self: Arc<Self>, id: &str, record: SandboxRecord) -> bool {
        let dir = self.sandbox_dir(id);
        let _ = fsutil::write_json_atomic(&dir.join("sandbox.json"), &record);
        let rt = self.runtime.clone();
        let (id2, dir2, slot) = (id.to_string(), dir.clone(), record.slot);
        let result = blocking(move || {
            // The final OOM count, while the cgroup still exists (see SandboxInfo::oom_kills).
            let oom_kills = rt.stats(&id2).map(|s| s.oom_kills);
            rt.destroy(&id2, Some(slot), &dir2)?;
            rt.remove_dir(&id2, &dir2)?;
            Ok(oom_kills)
        })
        .await;
        let mut st = self.lock();
        match result {
            Ok(oom_kills) => {
                st.live.remove(id);
                st.slots.release(record.slot);
                drop(st);
                self.pool.forget(id);
                let mut info = SandboxInfo::from_record(&record, PathBuf::new(), 0);
                info.state = SandboxState::Dead;
                info.oom_kills = oom_kills.unwrap_or(0);
                tracing::info!(sandbox = %id, reason = %info.death_reason.map(|r| r.as_str()).unwrap_or("?"), "sandbox removed");
                let mut dead = self.dead.lock().unwrap_or_else(|p| p.into_inner());
                dead.push_back(info);
                while dead.len() > DEAD_MEMORY {
                    dead.pop_front();
                }
                true
            }
            Err(e) => {
                tracing::error!(sandbox = %id, "teardown failed (will retry): {e}");
                if let Some(live) = st.live.get_mut(id) {
                    live.teardown_failed = true;
                }
                true
            }
        }
    }

    /// Called when a sandbox's init exited on its own.
    pub(crate) async fn on_init_exit(self: Arc<Self>, id: String) {
        let dir = self.sandbox_dir(&id);
        let rt = self.runtime.clone();
        let (i2, d2) = (id.clone(), dir.clone());
        let reason = tokio::task::spawn_blocking(move || rt.limit_hit(&i2, &d2))
            .await
            .ok()
            .flatten();
        self.finish(&id, reason.unwrap_or(DeathReason::Exited), false)
            .await;
    }
}

/// Watch `pid` (not our child) through a pidfd; when it exits, tear the sandbox down.
pub(crate) fn spawn_watcher(inner: Weak<Inner>, id: String, pid: i32) -> tokio::task::AbortHandle {
    let task = tokio::spawn(async move {
        // Err: the process is already gone.
        if let Ok(fd) = procfs::pidfd_open(pid) {
            // SAFETY: the OwnedFd is moved into the AsyncFd, which keeps it open until it
            // deregisters it on drop; nobody else closes it.
            match unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) } {
                Ok(afd) => {
                    let _ = afd.readable().await;
                }
                Err(e) => {
                    tracing::warn!(sandbox = %id, "cannot watch pid {pid}: {e}; polling");
                    while procfs::is_alive(pid, None) {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        }
        if let Some(inner) = inner.upgrade() {
            // A new task: finish() aborts this watcher task.
            tokio::spawn(inner.on_init_exit(id));
        }
    });
    task.abort_handle()
}

/// Per-sandbox `/etc/hosts` (so the hostname — the sandbox id — resolves; `sudo` wants
/// it) and `/etc/resolv.conf` (the host's nameservers unless they are loopback-only, which
/// a sandbox cannot reach; then public resolvers). Owned by the sandbox's root so that it
/// can edit them, like on any machine.
fn write_etc_files(dir: &Path, id: &str, uid_base: u32) -> Result<Vec<(PathBuf, PathBuf, bool)>> {
    let hosts = format!(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{id}\n"
    );
    let host_resolv = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    let servers: Vec<&str> = host_resolv
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .map(str::trim)
        .filter(|a| !a.starts_with("127.") && *a != "::1")
        .collect();
    let resolv = if servers.is_empty() {
        "nameserver 8.8.8.8\nnameserver 1.1.1.1\n".to_string()
    } else {
        servers
            .iter()
            .map(|s| format!("nameserver {s}\n"))
            .collect()
    };
    let mut out = Vec::new();
    for (name, content, target) in [
        ("hosts", hosts, "/etc/hosts"),
        ("resolv.conf", resolv, "/etc/resolv.conf"),
    ] {
        let p = dir.join(name);
        std::fs::write(&p, content).ctx("write", &p)?;
        give_to_sandbox_root(&p, uid_base)?;
        out.push((p, PathBuf::from(target), false));
    }
    Ok(out)
}

/// chown `path` to the sandbox's root (host uid/gid `uid_base`). Only root can; without
/// root (unit tests with a fake runtime) the file stays ours.
fn give_to_sandbox_root(path: &Path, uid_base: u32) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    std::os::unix::fs::chown(path, Some(uid_base), Some(uid_base)).ctx("chown", path)
}

/// Take `<state>/node.lock` exclusively (one node per state directory: reconciliation
/// must never see another live node's sandboxes as leftovers). Waits if it is held.
fn lock_node(path: &Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .ctx("open", path)?;
    // SAFETY: valid fd owned by `f`.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        tracing::warn!(
            "another cubicle node uses {}; waiting for it to exit",
            path.display()
        );
        eprintln!(
            "waiting for another cubicle process using {} to finish...",
            path.display()
        );
        // SAFETY: as above.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(Error::io("flock", path, std::io::Error::last_os_error()));
        }
    }
    Ok(f)
}

/// Run a blocking closure on the blocking pool.
/// A sandbox's environment: the template's, then the caller's, then E2B's own
/// `E2B_SANDBOX`, `E2B_SANDBOX_ID` and `E2B_TEMPLATE_ID` (which the caller cannot override).
pub(crate) fn sandbox_env(
    template: &Template,
    requested: &std::collections::BTreeMap<String, String>,
    id: &str,
) -> std::collections::BTreeMap<String, String> {
    let mut env = template.config.env.clone();
    env.extend(requested.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.insert("E2B_SANDBOX".into(), "true".into());
    env.insert("E2B_SANDBOX_ID".into(), id.into());
    env.insert("E2B_TEMPLATE_ID".into(), template.config.name.clone());
    env
}

impl Inner {
    /// Reserves a slot for new sandbox `id` and enters its `creating` record: the
    /// template's limits, user and workdir, internet on, a fresh access token, no env
    /// vars or metadata, ending now — then `customize` sets what differs.
    pub(crate) fn reserve(
        &self,
        id: &str,
        template: &Template,
        customize: impl FnOnce(&mut SandboxRecord),
    ) -> Result<SandboxRecord> {
        let mut st = self.lock();
        if st.live.contains_key(id) {
            return Err(Error::InvalidRequest(format!(
                "sandbox '{id}' already exists"
            )));
        }
        let slot = st.slots.allocate().ok_or_else(|| {
            Error::Capacity(format!(
                "all {} sandbox slots are in use",
                st.slots.in_use()
            ))
        })?;
        let now = now_ms();
        let c = &template.config;
        let mut record = SandboxRecord {
            id: id.to_string(),
            template: c.name.clone(),
            state: SandboxState::Creating,
            slot,
            uid_base: st.slots.uid_base(slot),
            pid: None,
            pid_start_time: None,
            created_at_ms: now,
            end_at_ms: now,
            memory_mb: c.memory_mb,
            cpus: c.cpus,
            disk_mb: c.disk_mb,
            internet: true,
            env_vars: Default::default(),
            metadata: Default::default(),
            access_token: ids::new_access_token(),
            default_user: c.default_user.clone(),
            default_workdir: c.default_workdir.clone(),
            death_reason: None,
            runtime: serde_json::Value::Null,
        };
        customize(&mut record);
        st.live.insert(id.to_string(), Live::new(record.clone()));
        Ok(record)
    }
}

pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Runtime(format!("blocking task failed: {e}")))?
}

/// Unix time in ms.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Ids of sandboxes whose records name `template` (to refuse removing a template in use).
pub fn sandboxes_using_template(state_dir: &Path, template: &str) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(state_dir.join("sandboxes")) else {
        return out;
    };
    for e in rd.flatten() {
        if let Ok(r) = fsutil::read_json::<SandboxRecord>(&e.path().join("sandbox.json"))
            && r.template == template
        {
            out.push(r.id);
        }
    }
    out
}

/// Records on disk (for `cubicle sandbox list` without a running node).
pub fn records_on_disk(state_dir: &Path) -> Vec<SandboxRecord> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(state_dir.join("sandboxes")) else {
        return out;
    };
    for e in rd.flatten() {
        if let Ok(r) = fsutil::read_json::<SandboxRecord>(&e.path().join("sandbox.json")) {
            out.push(r);
        }
    }
    out.sort_by_key(|r| r.created_at_ms);
    out
}

#[cfg(test)]
#[path = "node_tests.rs"]
mod tests;
