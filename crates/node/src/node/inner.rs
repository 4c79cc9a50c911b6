//! The node's shared core: [`Inner`] (configuration, runtime, the live sandboxes and
//! their slots, the pools), a slot and record for a new sandbox ([`Inner::reserve`]), and
//! the small helpers every path uses. The create path (`create.rs`), the death path
//! (`teardown.rs`), the pools, the reaper and reconciliation all work on [`Inner`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use cubicle_runtime::SandboxId;

use crate::config::NodeConfig;
use crate::error::{Error, IoContext, Result};
use crate::ids;
use crate::pool::Pool;
use crate::runtime::SandboxRuntime;
use crate::sandbox::{DeathReason, InitPidfd, SandboxInfo, SandboxRecord, SandboxState};
use crate::slots::UidSlots;
use crate::template::{Template, TemplateStore};

/// How many dead sandboxes `get` still remembers (with their death reason).
pub(crate) const DEAD_MEMORY: usize = 1024;
/// How long opening a node waits for another holder of the state directory before it
/// fails (unless told to wait for good).
const LOCK_GRACE: Duration = Duration::from_secs(3);

/// What every part of the node shares: configuration, runtime, the live sandboxes and
/// their slots, the pools. [`Node`](super::Node) is a handle on it.
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
    pub(super) _node_lock: std::fs::File,
    /// This node's slot range, registered host-wide (`None` for test runtimes).
    pub(super) _slot_lease: Option<crate::host_slots::SlotLease>,
    /// Warm pools and the cold-create semaphore (`pool/`).
    pub(crate) pool: Pool,
    /// Snapshot records (`<state>/snapshots`).
    pub(crate) snapshots: crate::snapshot::SnapshotStore,
    /// Called before a sandbox is checkpointed or stopped (see `Node::on_checkpoint`).
    pub(crate) on_checkpoint: std::sync::OnceLock<CheckpointHook>,
    /// The object store templates, snapshots and paused sandboxes move through
    /// (`moving.rs`); unset: none.
    pub(crate) object_store: std::sync::OnceLock<super::moving::ObjectStoreConfig>,
    /// The cluster's record of published paused sandboxes (`handover.rs`); unset: none.
    pub(crate) published_copies:
        std::sync::OnceLock<std::sync::Arc<dyn super::handover::PublishedCopies>>,
    /// When expired idle envd connections were last dropped (`idle_conn.rs`).
    pub(crate) idle_conn_sweep: Mutex<Option<std::time::Instant>>,
    /// Paused sandboxes being pulled from the object store, before they are in the live
    /// table (`moving.rs`, [`Node::info`](super::Node::info)).
    pub(crate) arriving: Mutex<HashSet<String>>,
}

/// Called with a sandbox's id before it is checkpointed or stopped (`Node::on_checkpoint`).
pub(crate) type CheckpointHook = Box<dyn Fn(&str) + Send + Sync>;

/// The live sandboxes and the uid slots, under one lock ([`Inner::lock`]).
pub(crate) struct State {
    /// Read with [`State::live`]; changed through [`State::live_mut`], which counts the
    /// change in `version` (what a listing shows comes from here).
    live: HashMap<SandboxId, Live>,
    /// Changes to `live` so far ([`crate::Node::listing_version`]).
    version: u64,
    pub(crate) slots: UidSlots,
    /// Volumes being deleted (`crate::volume`): no sandbox may mount them meanwhile.
    pub(crate) deleting_volumes: std::collections::HashSet<String>,
}

impl State {
    pub(crate) fn new(slots: UidSlots) -> Self {
        State {
            live: HashMap::new(),
            version: 0,
            slots,
            deleting_volumes: Default::default(),
        }
    }

    /// The sandboxes the node knows.
    pub(crate) fn live(&self) -> &HashMap<SandboxId, Live> {
        &self.live
    }

    /// The sandboxes, to change: counted as a change of what a listing shows.
    pub(crate) fn live_mut(&mut self) -> &mut HashMap<SandboxId, Live> {
        self.version += 1;
        &mut self.live
    }

    /// The sandboxes, to change only what a listing does not show ([`Live::envd_conn`],
    /// [`Live::watcher`]; every field [`Live::info`] reads needs [`State::live_mut`]):
    /// not counted, so the data plane's kept connections do not make every status poll
    /// list the node again.
    pub(crate) fn live_unlisted(&mut self) -> &mut HashMap<SandboxId, Live> {
        &mut self.live
    }

    pub(crate) fn version(&self) -> u64 {
        self.version
    }
}

/// A sandbox the node knows: its record, and what the node does about it.
pub(crate) struct Live {
    pub(crate) record: SandboxRecord,
    pub(crate) ready_us: u64,
    /// `kill` arrived while the sandbox was still being created.
    pub(crate) kill_requested: Option<DeathReason>,
    /// Teardown failed; the reaper retries it.
    pub(crate) teardown_failed: bool,
    pub(crate) watcher: Option<tokio::task::AbortHandle>,
    /// A pidfd of the init, from the moment the sandbox is live (see [`InitPidfd`]).
    pub(crate) init: Option<InitPidfd>,
    /// A pause, resume, snapshot or rollback is under way (`stateful.rs`).
    pub(crate) busy: Option<super::stateful::Busy>,
    /// An idle connection to its envd, for the next request (`idle_conn.rs`).
    pub(crate) envd_conn: Option<super::idle_conn::KeptConn>,
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
            init: None,
            busy: None,
            envd_conn: None,
        }
    }

    /// What callers see of it.
    pub(crate) fn info(&self, envd_socket: PathBuf) -> SandboxInfo {
        let mut info = SandboxInfo::from_record(&self.record, envd_socket, self.ready_us);
        info.init_pidfd = self.init.clone();
        info.busy = self.busy.is_some();
        info
    }
}

impl Inner {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Inner::arriving`], locked.
    pub(crate) fn arrivals(&self) -> MutexGuard<'_, HashSet<String>> {
        self.arriving.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.config.state_dir.join("sandboxes").join(id)
    }

    pub(crate) fn envd_socket(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("ctl").join(super::ENVD_SOCKET)
    }

    /// The pidfd of sandbox `id`'s init (`pid`, started at `start_time`): the runtime's
    /// own when it holds one, else a new one. `None`: that process is gone.
    pub(crate) fn init_pidfd(
        &self,
        id: &str,
        pid: i32,
        start_time: Option<u64>,
    ) -> Option<InitPidfd> {
        match self.runtime.init_pidfd(id) {
            Some(fd) => Some(InitPidfd::shared(fd)),
            None => InitPidfd::open(pid, start_time),
        }
    }

    /// Live counters of a live sandbox's info (OOM kills so far).
    pub(crate) fn fill_counters(&self, info: &mut SandboxInfo) {
        if let Some(s) = self.runtime.stats(&info.id) {
            info.oom_kills = s.oom_kills;
        }
    }

    /// Reserves a slot for new sandbox `id` (`kept`, if given: one marked used already,
    /// [`Inner::make_room`]'s) and enters its `creating` record: the template's limits,
    /// user and workdir, internet on, a fresh access token, no env vars or metadata,
    /// ending now — then `customize` sets what differs.
    pub(crate) fn reserve(
        &self,
        id: &SandboxId,
        template: &Template,
        kept: Option<u32>,
        customize: impl FnOnce(&mut SandboxRecord),
    ) -> Result<SandboxRecord> {
        let mut st = self.lock();
        if st.live().contains_key(id) {
            if let Some(slot) = kept {
                st.slots.release(slot);
            }
            return Err(Error::InvalidRequest(format!(
                "sandbox '{id}' already exists"
            )));
        }
        let slot = match kept {
            Some(slot) => slot,
            None => st.slots.allocate().ok_or_else(|| {
                Error::Capacity(format!(
                    "all {} sandbox slots are in use",
                    st.slots.in_use()
                ))
            })?,
        };
        let now = now_ms();
        let c = &template.config;
        let mut record = SandboxRecord {
            id: id.clone(),
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
            network: Default::default(),
            mask_request_host: None,
            env_vars: Default::default(),
            metadata: Default::default(),
            access_token: ids::new_access_token(),
            default_user: c.default_user.clone(),
            default_workdir: c.default_workdir.clone(),
            death_reason: None,
            runtime: serde_json::Value::Null,
            lifecycle: Default::default(),
            timeout_ms: 0,
            pause_mode: None,
            paused_at_ms: None,
            envd_unresponsive_at_pause: false,
            base_template: None,
            volumes: Vec::new(),
            layers: c.layers.clone(),
        };
        customize(&mut record);
        // In the same critical section as the insert: a volume being deleted is never
        // mounted (`Node::delete_volume` checks the live records under this lock).
        st.check_volumes_usable(&record.volumes)?;
        st.live_mut().insert(id.clone(), Live::new(record.clone()));
        Ok(record)
    }
}

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
    if template
        .rootfs
        .join(super::create::CA_BUNDLE_TARGET.trim_start_matches('/'))
        .is_file()
    {
        // Clients with a CA bundle of their own (Python requests/certifi, Node) use the
        // system one, which trusts the node's egress CA (header rules, docs/network.md).
        for k in ["REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"] {
            env.entry(k.into())
                .or_insert_with(|| super::create::CA_BUNDLE_TARGET.into());
        }
    }
    env
}

/// envd's (PID 1's) environment: the template's; the access token envd requires from
/// its first request on (`CUBICLE_ENVD_ACCESS_TOKEN`), so that a sandbox is never
/// reachable without a secret, also while it waits unclaimed in a pool (a claim hands
/// that token to the user); and the sandbox's own environment when `record` has one that
/// fits ([`born_init`]). (Processes started through envd do not inherit envd's
/// environment.)
pub(crate) fn birth_env(
    template: &Template,
    record: &SandboxRecord,
) -> std::collections::BTreeMap<String, String> {
    let mut env = template.config.env.clone();
    env.insert(
        "CUBICLE_ENVD_ACCESS_TOKEN".into(),
        record.access_token.clone(),
    );
    // envd writes the identity files at its start (a pool's refill, at low priority),
    // and a claim's `/init` (when it sends one) with the same ids need not.
    env.insert("CUBICLE_ENVD_SANDBOX_ID".into(), record.id.to_string());
    env.insert(
        "CUBICLE_ENVD_TEMPLATE_ID".into(),
        template.config.name.clone(),
    );
    if let Some(json) = birth_env_vars(record) {
        env.insert("CUBICLE_ENVD_ENV_VARS".into(), json);
    }
    env
}

/// The largest sandbox environment (as JSON) envd is given at its birth; a larger one (a
/// create's own variables can be big) goes through `/init`. Far below the kernel's limit
/// on one environment string (128 KiB).
const BIRTH_ENV_VARS_MAX: usize = 32 << 10;

/// `record`'s sandbox environment as envd is born with it (`CUBICLE_ENVD_ENV_VARS`), if
/// it has one (a shell, made before its template is known, has none) and it fits.
fn birth_env_vars(record: &SandboxRecord) -> Option<String> {
    if record.env_vars.is_empty() {
        return None;
    }
    serde_json::to_string(&record.env_vars)
        .ok()
        .filter(|json| json.len() <= BIRTH_ENV_VARS_MAX)
}

/// What envd knows from its birth ([`birth_env`] of `record`), as the `/init` that would
/// tell it the same; `None` when it was born without the sandbox's environment. A create
/// whose `/init` would be this one skips it: a claim from a pool then does not wake the
/// pooled sandbox's envd at all (docs/bench.md, round 33).
pub(crate) fn born_init(record: &SandboxRecord) -> Option<crate::envd_client::InitRequest> {
    birth_env_vars(record).map(|_| crate::envd_client::InitRequest::for_record(record))
}

/// The `/init` a sandbox's envd needs right after its birth to serve `record` as it was
/// born for (a cold create, a pooled start command): all of it when the environment did
/// not fit its birth ([`born_init`] is none), else none — [`init_needed`] of
/// `born_init(record)`, without building and comparing the same request twice.
pub(crate) fn init_after_birth(record: &SandboxRecord) -> Option<crate::envd_client::InitRequest> {
    birth_env_vars(record)
        .is_none()
        .then(|| crate::envd_client::InitRequest::for_record(record))
}

/// The `/init` the envd of a sandbox needs to serve `record`, born knowing `born`
/// ([`born_init`] of its record at its birth, e.g. before a claim changed it): none when
/// that is all of it (a cold create's environment that fitted; a claim that asks for no
/// variables, with the template's user and directory).
pub(crate) fn init_needed(
    born: Option<&crate::envd_client::InitRequest>,
    record: &SandboxRecord,
) -> Option<crate::envd_client::InitRequest> {
    let wanted = crate::envd_client::InitRequest::for_record(record);
    (born != Some(&wanted)).then_some(wanted)
}

/// Run a blocking closure on the blocking pool.
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

/// Take `<state>/node.lock` exclusively (one node per state directory: reconciliation
/// must never see another live node's sandboxes as leftovers), and write who holds it
/// into it. When it is held: wait (`wait`), or fail after [`LOCK_GRACE`] with a message
/// that names the holder and says what to do instead.
pub(super) fn lock_node(path: &Path, wait: bool) -> Result<std::fs::File> {
    use std::io::{Seek, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .ctx("open", path)?;
    let try_lock = || cubicle_syscalls::fs::lock_exclusive(&f, false).is_ok();
    // A short-lived holder (`cubicle local list`, the guardian of a killed `cubicle run`
    // cleaning up) is waited for; a server is not.
    let grace = std::time::Instant::now() + LOCK_GRACE;
    let mut locked = try_lock();
    while !locked && !wait && std::time::Instant::now() < grace {
        std::thread::sleep(Duration::from_millis(50));
        locked = try_lock();
    }
    if !locked {
        let holder = std::fs::read_to_string(path).unwrap_or_default();
        let holder = holder.trim();
        let holder = if holder.is_empty() {
            "another process".to_string()
        } else {
            format!("process {holder}")
        };
        let dir = path.parent().unwrap_or(path).display();
        if !wait {
            return Err(Error::StateDirBusy(format!(
                "the state directory {dir} is in use by {holder} (one Cubicle node per state directory). If that is `cubicle serve`, use it: `cubicle sandbox create` and `cubicle sandbox exec ID -- CMD`. Or give this command a state directory and slots of its own: `cubicle --state-dir /var/lib/cubicle-run --first-slot 8192 run -- CMD`."
            )));
        }
        tracing::warn!("{dir} is in use by {holder}; waiting for it to exit");
        eprintln!("waiting for {holder}, which uses {dir}, to finish...");
        cubicle_syscalls::fs::lock_exclusive(&f, true).map_err(|e| Error::io("flock", path, e))?;
    }
    let cmdline = std::fs::read("/proc/self/cmdline")
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .unwrap_or_default();
    let me = format!("{} ({})\n", std::process::id(), cmdline.trim());
    let _ = f
        .set_len(0)
        .and_then(|()| f.rewind())
        .and_then(|()| f.write_all(me.as_bytes()));
    Ok(f)
}
