//! The control plane's behaviour, free of HTTP: executes typed commands against the
//! node ([`Backend`]) and the store, enforces team ownership (another team's sandbox is
//! indistinguishable from a missing one: 404), keeps the store in step with the node
//! (deaths the node noticed by itself — timeout, OOM, exit — are recorded with their
//! reason), mirrors logs and samples metrics into a bounded history ([`crate::metrics`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cubicle_node::{CreateRequest, SandboxInfo, SandboxState};
use cubicle_store::{IdempotencyClaim, SandboxRow, SandboxRowState, Store, Team, now_ms};

use crate::backend::{Backend, LogMarks};
use crate::commands::{
    Connect, CreateSandbox, CreateSnapshot, Fork, Idempotency, Limits, ListFilter, ListSnapshots,
    Pause, Refresh, Resume, Rollback, SetTimeout,
};
use crate::error::{ApiError, ApiResult};
use crate::events::{EventKind, Events};
use crate::logs::{LogLine, LogMirror};
use crate::metrics::{MetricsHistory, Shape};
use crate::model::{
    CLIENT_ID, ENVD_VERSION, ForkError, ForkResult, Lifecycle, ListedSandbox, Network, Sandbox,
    SandboxDetail, SandboxMetric, SnapshotInfo,
};
use crate::query::{encode_cursor, format_time};
use crate::telemetry::{SandboxUsage, Snapshot, Telemetry};
use crate::webhooks::{WebhookConfig, Webhooks};

/// Log growth up to this many bytes is mirrored inline, more on the blocking pool.
const INLINE_LOG_SYNC: u64 = 16 << 10;

/// Control-plane settings.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Timeout limits.
    pub limits: Limits,
    /// `domain` returned to SDKs (`None` → `null`: clients use `E2B_SANDBOX_URL`).
    pub domain: Option<String>,
    /// How template builds reach image registries (mirrors, plain-HTTP registries).
    pub registry: cubicle_node::template::oci::pull::RegistryOptions,
    /// Where sandbox logs are mirrored (`<state>/logs`).
    pub logs_dir: PathBuf,
    /// How long records and logs of ended sandboxes are kept.
    pub retention: Duration,
    /// The server's key: seals secret values, derives volume tokens (`keyring.rs`).
    pub keyring: Arc<crate::keyring::Keyring>,
    /// Volume sizes and counts (`volumes.rs`).
    pub volumes: crate::volumes::VolumeLimits,
    /// How webhook deliveries are attempted.
    pub webhooks: WebhookConfig,
}

impl ApiConfig {
    /// Defaults: 300 s default timeout, 24 h max, resources up to the host's, logs in `logs_dir`, 24 h retention.
    pub fn new(logs_dir: PathBuf) -> Self {
        ApiConfig {
            limits: Limits::for_host(),
            domain: None,
            registry: Default::default(),
            logs_dir,
            retention: Duration::from_secs(24 * 3600),
            keyring: Arc::new(crate::keyring::Keyring::ephemeral()),
            volumes: crate::volumes::VolumeLimits::default(),
            webhooks: WebhookConfig::default(),
        }
    }
}

/// A node error that says nothing about the sandbox's life (in a cluster: its node does
/// not answer, or the database did not): the sandbox is not recorded as dead for it.
fn fate_unknown(e: &cubicle_node::Error) -> bool {
    !matches!(e, cubicle_node::Error::SandboxNotFound(_))
}

/// A sandbox id can only be one of ours if it looks like one.
fn plausible_id(id: &str) -> bool {
    cubicle_node::SandboxId::is_valid(id)
}

/// The control plane.
pub struct ControlPlane {
    backend: Arc<dyn Backend>,
    store: Store,
    config: ApiConfig,
    /// Live sandboxes created through the API → their traffic token (read by the router
    /// without touching the database).
    routes: Mutex<HashMap<String, Option<String>>>,
    /// Metric samples of the live sandboxes.
    metrics: MetricsHistory,
    logs: Arc<LogMirror>,
    /// Where the upkeep's mirror got to in the nodes' logs ([`Backend::grown_logs`]).
    log_marks: Mutex<LogMarks>,
    /// Sandboxes whose log grew while they were paused: copied once they run again.
    logs_waiting: Mutex<HashSet<String>>,
    /// Template builds (E2B's builder API).
    pub(crate) builds: crate::template_builds::Builds,
    /// Metrics.
    telemetry: Arc<Telemetry>,
    /// Lifecycle events (stored, logged, delivered to webhooks).
    events: Events,
    /// One of several replicas over one database ([`ControlPlane::set_shared`]).
    shared: std::sync::atomic::AtomicBool,
    /// The teams' webhooks.
    webhooks: Arc<Webhooks>,
    /// API keys read from PostgreSQL, trusted for a bounded time (`crate::key_cache`).
    keys: crate::key_cache::KeyCache,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ControlPlane {
    /// Set up over a node and a store: sandboxes the store thinks are running are
    /// checked against the node (adopted if alive, recorded as ended otherwise).
    pub async fn open(
        backend: Arc<dyn Backend>,
        store: Store,
        config: ApiConfig,
    ) -> ApiResult<Arc<Self>> {
        let telemetry = Arc::new(Telemetry::new());
        let webhooks =
            Webhooks::open(store.clone(), config.webhooks.clone(), telemetry.clone()).await?;
        let events = Events::start(store.clone(), telemetry.clone(), webhooks.clone());
        let cp = Arc::new(ControlPlane {
            logs: Arc::new(LogMirror::new(config.logs_dir.clone())),
            log_marks: Mutex::default(),
            logs_waiting: Mutex::default(),
            backend,
            store,
            config,
            routes: Mutex::new(HashMap::new()),
            metrics: MetricsHistory::default(),
            builds: Default::default(),
            telemetry,
            events,
            webhooks,
            shared: Default::default(),
            keys: Default::default(),
        });
        let rows = cp.store.call(|s| s.running_sandboxes(None)).await?;
        for row in rows {
            match cp.backend.peek(&row.id) {
                Ok(info) if is_live(info.state) => {
                    lock(&cp.routes).insert(row.id.clone(), row.traffic_access_token.clone());
                }
                Err(e) if fate_unknown(&e) => {
                    // Its node (of a cluster) does not answer now: kept, checked again.
                    tracing::warn!(sandbox = %row.id, "cannot check the sandbox now: {e}");
                    lock(&cp.routes).insert(row.id.clone(), row.traffic_access_token.clone());
                }
                other => {
                    let reason = other
                        .ok()
                        .and_then(|i| i.death_reason)
                        .map(|r| r.as_str())
                        .unwrap_or("lost");
                    let id = row.id.clone();
                    let reason = reason.to_string();
                    cp.ended(&row, &reason);
                    cp.store
                        .call(move |s| s.mark_ended(&id, &reason, now_ms()))
                        .await?;
                }
            }
        }
        cp.reconcile_volumes().await?;
        Ok(cp)
    }

    /// The settings.
    pub fn config(&self) -> &ApiConfig {
        &self.config
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Forgets the API keys read from the database (a key was revoked through this
    /// process: refused at once here, within `key_cache::KEY_CACHE_TTL` elsewhere).
    pub fn forget_keys(&self) {
        self.keys.clear();
    }

    /// The node.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The metrics (for the HTTP middleware and the template-build observer).
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        &self.telemetry
    }

    /// The lifecycle events (events API).
    pub fn events(&self) -> &Events {
        &self.events
    }

    /// The teams' webhooks.
    pub fn webhooks(&self) -> &Arc<Webhooks> {
        &self.webhooks
    }

    /// Whether `team` is the operator's (the admin team `cubicle serve` creates): it may
    /// read the node-wide metrics.
    pub fn is_admin(&self, team: &Team) -> bool {
        team.name == crate::ADMIN_TEAM
    }

    // ---- lifecycle ----

    /// The lifecycle hook: every change of a sandbox's life goes through here (create,
    /// end-time changes, kill and natural ends in this file; pause and resume from the
    /// stateful-sandbox code). It logs the change at `info`, counts it, stores it for
    /// the events API and delivers it to the team's webhooks (see [`crate::events`]).
    /// `data` adds to the event's `eventData`.
    pub fn lifecycle(
        &self,
        kind: EventKind,
        row: &SandboxRow,
        data: serde_json::Map<String, serde_json::Value>,
    ) {
        self.events.emit(kind, row, data);
    }

    /// A sandbox of `row` ended with `reason`: the `killed` event and the metrics.
    fn ended(&self, row: &SandboxRow, reason: &str) {
        self.telemetry.ended(&row.id, reason);
        let mut data = serde_json::Map::new();
        data.insert("death_reason".into(), reason.into());
        self.lifecycle(EventKind::Killed, row, data);
    }

    /// What a metrics scrape reads now (memory and a few host files; no cgroup reads).
    pub fn metrics_snapshot(&self) -> Snapshot {
        let ids: Vec<String> = lock(&self.routes).keys().cloned().collect();
        let mut snap = Snapshot {
            pool: self.backend.pool(),
            host: self.backend.host(),
            egress_relayed: self.backend.egress_relayed(),
            ..Default::default()
        };
        let mut templates = HashMap::new();
        for id in &ids {
            if let Ok(info) = self.backend.peek(id) {
                let state = serde_json::to_value(info.state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_else(|| "unknown".into());
                *snap
                    .sandboxes
                    .entry((state, info.template.clone()))
                    .or_default() += 1;
                templates.insert(id.clone(), info.template);
            }
        }
        snap.usage = self
            .metrics
            .usage()
            .into_iter()
            .filter_map(|(id, cpu_ns, mem, disk)| {
                Some(SandboxUsage {
                    template: templates.get(&id)?.clone(),
                    id,
                    cpu_seconds: cpu_ns as f64 / 1e9,
                    memory_bytes: mem,
                    disk_bytes: disk,
                })
            })
            .collect();
        let hooks = self.webhooks.all();
        let enabled = hooks.iter().filter(|w| w.enabled).count() as u64;
        snap.webhooks = (enabled, hooks.len() as u64 - enabled);
        snap
    }

    /// Ids of live API sandboxes with their traffic tokens.
    pub fn routes(&self) -> Vec<(String, Option<String>)> {
        lock(&self.routes)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The traffic token of a live API sandbox (`None` = unknown to the API). A replica
    /// of a cluster also learns here, from the database, the sandboxes created through
    /// the other replicas.
    pub fn route(&self, id: &str) -> Option<Option<String>> {
        if let Some(r) = lock(&self.routes).get(id).cloned() {
            return Some(r);
        }
        if !self.shared.load(std::sync::atomic::Ordering::Relaxed) || !plausible_id(id) {
            return None;
        }
        let row = self.store.read(|s| s.sandbox(id)).ok()??;
        (row.state == SandboxRowState::Running).then(|| {
            lock(&self.routes).insert(row.id.clone(), row.traffic_access_token.clone());
            row.traffic_access_token
        })
    }

    /// Whether this control plane is one of several replicas over one database.
    pub fn is_shared(&self) -> bool {
        self.shared.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Makes this control plane one of several replicas over one database: sandboxes
    /// created through the others are routed too (see [`ControlPlane::route`]).
    pub fn set_shared(&self) {
        self.shared
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sandboxes the cluster ended without this replica's doing (their node was lost;
    /// `(id, team)` as the store reported them): the `killed` event with `reason`, and
    /// gone from the routes.
    pub async fn reported_ended(&self, sandboxes: &[(String, i64)], reason: &str) {
        for (id, _) in sandboxes {
            lock(&self.routes).remove(id);
            self.metrics.forget(id);
            let id2 = id.clone();
            match self.store.call(move |s| s.sandbox(&id2)).await {
                Ok(Some(row)) => self.ended(&row, reason),
                Ok(None) => {}
                Err(e) => tracing::warn!(sandbox = %id, "reading an ended sandbox: {e}"),
            }
        }
    }

    // ---- auth ----

    /// The team of an API key.
    pub async fn authenticate(&self, key: Option<&str>) -> ApiResult<Team> {
        let Some(key) = key.filter(|k| !k.is_empty()) else {
            return Err(ApiError::Unauthorized(
                "missing API key: send it in the X-API-KEY header".into(),
            ));
        };
        // Inline on the read connection: every request starts here. Recording the use
        // (at most once a minute per key) is a write: on the blocking pool, not awaited.
        // On PostgreSQL a key found is trusted for a bounded time (`crate::key_cache`).
        let hash = (self.store.dialect() == cubicle_store::Dialect::Postgres)
            .then(|| cubicle_store::hash_key(key));
        let found = match hash.as_deref().and_then(|h| self.keys.get(h)) {
            Some(k) => k,
            None => {
                let k = self
                    .store
                    .read(|s| s.find_key(key))?
                    .ok_or_else(|| ApiError::Unauthorized("Invalid API key".into()))?;
                if let Some(h) = &hash {
                    self.keys.put(h.clone(), k.clone());
                }
                k
            }
        };
        let now = cubicle_store::now_ms();
        if found.use_is_stale(now) {
            if let Some(h) = &hash {
                self.keys.used(h, now);
            }
            let (store, key_id) = (self.store.clone(), found.key_id);
            tokio::spawn(async move {
                if let Err(e) = store.call(move |s| s.record_key_use(key_id)).await {
                    tracing::warn!("recording an API key's use: {e}");
                }
            });
        }
        Ok(found.team)
    }

    // ---- create ----

    /// Create a sandbox (with an optional idempotency key).
    pub async fn create(
        &self,
        team: &Team,
        cmd: CreateSandbox,
        idem: Option<Idempotency>,
    ) -> ApiResult<Sandbox> {
        let mut cmd = cmd;
        if let Some(snap) = self.team_snapshot(team, &cmd.template_id) {
            // A snapshot of this team: the node starts the sandbox from it.
            cmd.template = Ok(crate::templates::TemplateRef {
                name: snap.id.clone(),
                requested: cmd.template_id.clone(),
                tag: None,
            });
        }
        let tref = cmd.template.clone().map_err(ApiError::from)?;
        if let Some(snap) = self.backend.find_snapshot(&tref.name)
            && snap.owner != team.id.to_string()
        {
            // Another team's snapshot is as unknown as a missing template.
            return Err(ApiError::NotFound(format!(
                "template '{}' not found",
                tref.requested
            )));
        }
        // Inline: reads one small file (no hop to the blocking pool on every create).
        let visible = self
            .backend
            .template_owner(&tref.name)
            .is_none_or(|o| o == team.id.to_string());
        if self.backend.find_snapshot(&tref.name).is_none()
            && (!visible || !self.backend.template_exists(&tref.node_ref())?)
        {
            return Err(ApiError::NotFound(format!(
                "template '{}' not found (built-in templates: base, tiny; build others with `cubicle template build`)",
                tref.requested
            )));
        }
        self.backend.check_network(&cmd.network).await?;
        self.check_rule_secrets(team, &cmd.network)?;
        let team_id = team.id;
        if let Some(idem) = &idem {
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            loop {
                let (k, h) = (idem.key.clone(), idem.request_hash.clone());
                let claim = self
                    .store
                    .call(move |s| s.claim_idempotency_key(team_id, &k, &h))
                    .await?;
                match claim {
                    IdempotencyClaim::Claimed => break,
                    IdempotencyClaim::Done(id) => {
                        let info = self
                            .backend
                            .peek(&id)
                            .ok()
                            .filter(|i| i.state == SandboxState::Running);
                        let row = self.store.call(move |s| s.sandbox(&id)).await?;
                        return match (row, info) {
                            (Some(row), Some(info))
                                if row.team_id == team_id
                                    && row.state == SandboxRowState::Running =>
                            {
                                Ok(self.sandbox_body(&row, &info))
                            }
                            _ => Err(ApiError::Conflict(
                                "the sandbox created for this Idempotency-Key no longer exists"
                                    .into(),
                            )),
                        };
                    }
                    IdempotencyClaim::Mismatch => {
                        return Err(ApiError::Conflict(
                            "Idempotency-Key was already used with a different request".into(),
                        ));
                    }
                    IdempotencyClaim::InFlight if std::time::Instant::now() < deadline => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    IdempotencyClaim::InFlight => {
                        return Err(ApiError::Conflict(
                            "a request with this Idempotency-Key is still in progress".into(),
                        ));
                    }
                }
            }
        }
        let result = self.create_claimed(team, cmd, tref).await;
        if let Some(idem) = idem {
            let key = idem.key.clone();
            let done = result.as_ref().ok().map(|s| s.sandbox_id.clone());
            let r = self
                .store
                .call(move |s| match done {
                    Some(id) => s.complete_idempotency_key(team_id, &key, &id),
                    None => s.release_idempotency_key(team_id, &key),
                })
                .await;
            if let Err(e) = r {
                tracing::warn!("idempotency bookkeeping failed: {e}");
            }
        }
        result
    }

    async fn create_claimed(
        &self,
        team: &Team,
        cmd: CreateSandbox,
        template: crate::templates::TemplateRef,
    ) -> ApiResult<Sandbox> {
        let env_var_names: Vec<String> = cmd.env_vars.keys().cloned().collect();
        let volumes = self.resolve_mounts(team, &cmd.volume_mounts)?;
        let t0 = std::time::Instant::now();
        let info = self
            .backend
            .create(CreateRequest {
                template: template.node_ref(),
                id: None,
                env_vars: cmd.env_vars,
                memory_mb: cmd.memory_mb,
                cpus: cmd.cpus,
                disk_mb: cmd.disk_mb,
                internet: cmd.internet,
                network: cmd.network,
                mask_request_host: cmd.mask_request_host,
                timeout: Some(cmd.timeout),
                metadata: cmd.metadata.clone(),
                lifecycle: cmd.lifecycle,
                volumes,
            })
            .await?;
        let row = SandboxRow {
            id: info.id.to_string(),
            team_id: team.id,
            template_id: info.template.clone(),
            alias: Some(info.template.clone()),
            metadata: cmd.metadata,
            env_var_names,
            traffic_access_token: cmd
                .private_traffic
                .then(cubicle_node::ids::new_access_token),
            allow_internet: info.network.needs_network(),
            cpu_count: info.cpus,
            memory_mb: info.memory_mb,
            disk_mb: info.disk_mb,
            started_at: info.created_at_ms as i64,
            end_at: info.end_at_ms as i64,
            state: SandboxRowState::Running,
            death_reason: None,
            ended_at: None,
        };
        self.register_new(&row, &info.id).await?;
        self.telemetry.created(info.claimed, t0.elapsed());
        let mut data = serde_json::Map::new();
        data.insert(
            "source".into(),
            if info.claimed { "pool" } else { "cold" }.into(),
        );
        self.lifecycle(EventKind::Created, &row, data);
        Ok(self.sandbox_body(&row, &info))
    }

    /// The `Sandbox` body: the row's facts, the envd token from the node's record (the
    /// database does not keep it).
    fn sandbox_body(&self, row: &SandboxRow, info: &SandboxInfo) -> Sandbox {
        Sandbox {
            template_id: row.template_id.clone(),
            sandbox_id: row.id.clone(),
            client_id: CLIENT_ID,
            envd_version: ENVD_VERSION,
            alias: row.alias.clone(),
            envd_access_token: info.access_token.clone(),
            traffic_access_token: row.traffic_access_token.clone(),
            domain: self.config.domain.clone(),
        }
    }

    // ---- one sandbox ----

    /// Record that a sandbox is gone (with the node's reason when it still knows it).
    async fn mark_dead(&self, id: &str, info: Option<&SandboxInfo>) {
        let reason = info
            .and_then(|i| i.death_reason)
            .map(|r| r.as_str())
            .unwrap_or("lost")
            .to_string();
        // The first to notice records the end (kill() has done so already).
        // (Not when its row is ended already: another replica of a cluster recorded it.)
        if lock(&self.routes).remove(id).is_some()
            && let Ok(Some(row)) = self.store.read(|s| s.sandbox(id))
            && row.state == SandboxRowState::Running
        {
            self.ended(&row, &reason);
        }
        self.metrics.forget(id);
        let id2 = id.to_string();
        if let Err(e) = self
            .store
            .call(move |s| s.mark_ended(&id2, &reason, now_ms()))
            .await
        {
            tracing::warn!(sandbox = %id, "cannot record the end of the sandbox: {e}");
        }
    }

    /// A running sandbox of `team`, or 404 (a paused one too).
    pub async fn owned(&self, team: &Team, id: &str) -> ApiResult<(SandboxRow, SandboxInfo)> {
        let (row, info) = self.owned_live(team, id).await?;
        if is_paused(info.state) {
            return Err(ApiError::sandbox_not_found(id));
        }
        Ok((row, info))
    }

    /// A running or paused sandbox of `team`, or 404.
    pub async fn owned_live(&self, team: &Team, id: &str) -> ApiResult<(SandboxRow, SandboxInfo)> {
        if !plausible_id(id) {
            return Err(ApiError::sandbox_not_found(id));
        }
        let row = self.store.read(|s| s.sandbox(id))?;
        let Some(row) = row.filter(|r| r.team_id == team.id && r.state == SandboxRowState::Running)
        else {
            return Err(ApiError::sandbox_not_found(id));
        };
        match self.backend.current(id).await {
            Ok(info) if is_live(info.state) => Ok((row, info)),
            Err(e) if fate_unknown(&e) => Err(e.into()),
            other => {
                self.mark_dead(id, other.as_ref().ok()).await;
                Err(ApiError::sandbox_not_found(id))
            }
        }
    }

    /// `GET /sandboxes/{id}`.
    pub async fn detail(&self, team: &Team, id: &str) -> ApiResult<SandboxDetail> {
        let (row, info) = self.owned_live(team, id).await?;
        let paused = is_paused(info.state);
        Ok(SandboxDetail {
            template_id: row.template_id.clone(),
            sandbox_id: row.id.clone(),
            client_id: CLIENT_ID,
            started_at: format_time(row.started_at),
            end_at: format_time(end_at(&info)),
            envd_version: ENVD_VERSION,
            cpu_count: row.cpu_count,
            memory_mb: row.memory_mb,
            disk_size_mb: row.disk_mb,
            state: state_word(info.state),
            alias: row.alias.clone(),
            envd_access_token: info.access_token.clone(),
            allow_internet_access: !info.network.deny_all(),
            domain: if paused {
                None
            } else {
                self.config.domain.clone()
            },
            metadata: row.metadata.clone(),
            network: Network::of(
                &info.network,
                row.traffic_access_token.is_none(),
                info.mask_request_host.clone(),
            ),
            lifecycle: lifecycle(&info),
            pause_mode: (info.state == SandboxState::Paused)
                .then(|| info.pause_mode.map(|m| m.as_str()))
                .flatten(),
            envd_unresponsive_at_pause: info.envd_unresponsive_at_pause.then_some(true),
            volume_mounts: self.mount_bodies(&info.volumes),
        })
    }

    /// `DELETE /sandboxes/{id}`.
    pub async fn kill(self: &Arc<Self>, team: &Team, id: &str) -> ApiResult<()> {
        let (row, _) = self.owned_live(team, id).await?;
        // Keep the last lines: the node deletes the log with the sandbox.
        self.sync_logs(id).await;
        match self.backend.kill(id).await {
            // NotFound: it died on its own meanwhile; either way it is gone now.
            Ok(()) | Err(cubicle_node::Error::SandboxNotFound(_)) => {
                // Gone for the router and the node now; the database row follows in the
                // background (a request that reads it meanwhile still asks the node, and
                // after a crash the startup check records the end).
                if lock(&self.routes).remove(id).is_some() {
                    self.ended(&row, "killed");
                }
                let info = self.backend.peek(id).ok();
                let (cp, id) = (self.clone(), id.to_string());
                tokio::spawn(async move { cp.mark_dead(&id, info.as_ref()).await });
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn apply_end(
        &self,
        row: &SandboxRow,
        timeout: Duration,
        extend_only: bool,
    ) -> ApiResult<()> {
        let id = row.id.as_str();
        let backend = self.backend.clone();
        let id2 = id.to_string();
        let end = tokio::task::spawn_blocking(move || -> cubicle_node::Result<Option<u64>> {
            let cur = backend.peek(&id2)?.end_at_ms;
            let wanted = now_ms() as u64 + timeout.as_millis() as u64;
            if extend_only && wanted <= cur {
                return Ok(None);
            }
            backend.set_timeout(&id2, timeout)?;
            Ok(Some(backend.peek(&id2)?.end_at_ms))
        })
        .await
        .map_err(|e| ApiError::Internal(format!("timeout task: {e}")))??;
        if let Some(end) = end {
            let id2 = id.to_string();
            self.store
                .call(move |s| s.set_end_at(&id2, end as i64))
                .await?;
            let mut data = serde_json::Map::new();
            data.insert("set_timeout".into(), format_time(end as i64).into());
            self.lifecycle(EventKind::Updated, row, data);
        }
        Ok(())
    }

    /// `POST /sandboxes/{id}/timeout`.
    pub async fn set_timeout(&self, team: &Team, id: &str, cmd: SetTimeout) -> ApiResult<()> {
        let (row, _) = self.owned(team, id).await?;
        self.apply_end(&row, cmd.timeout, false).await
    }

    /// `POST /sandboxes/{id}/refreshes`.
    pub async fn refresh(&self, team: &Team, id: &str, cmd: Refresh) -> ApiResult<()> {
        let (row, _) = self.owned(team, id).await?;
        self.apply_end(&row, cmd.duration, true).await
    }

    /// `POST /v2/sandboxes/{id}/connect` (and v1): running → end extended, `false`;
    /// paused → resumed, `true` (201).
    pub async fn connect(&self, team: &Team, id: &str, cmd: Connect) -> ApiResult<(Sandbox, bool)> {
        let (row, info) = self.owned_live(team, id).await?;
        if !is_paused(info.state) && !info.busy {
            self.apply_end(&row, cmd.timeout, true).await?;
            return Ok((self.sandbox_body(&row, &info), false));
        }
        if info.envd_unresponsive_at_pause && cmd.memory {
            return Err(ApiError::GuestUnresponsive(format!(
                "sandbox '{id}' was paused while its envd did not answer; connect with memory=false (on_resume=\"reboot\") to boot it from its disk"
            )));
        }
        let out = self.backend.resume(id, cmd.timeout, cmd.memory).await?;
        if out.resumed {
            let end = out.info.end_at_ms as i64;
            let id2 = id.to_string();
            self.store.call(move |s| s.set_end_at(&id2, end)).await?;
            self.lifecycle(EventKind::Resumed, &row, serde_json::Map::new());
        }
        Ok((self.sandbox_body(&row, &out.info), out.resumed))
    }

    /// `POST /sandboxes/{id}/resume` (deprecated): paused → resumed; running → 409.
    pub async fn resume(&self, team: &Team, id: &str, cmd: Resume) -> ApiResult<Sandbox> {
        let (row, info) = self.owned_live(team, id).await?;
        if !is_paused(info.state) && !info.busy {
            return Err(ApiError::Conflict(format!(
                "Sandbox {id} is already running"
            )));
        }
        let out = self.backend.resume(id, cmd.timeout, cmd.memory).await?;
        let end = out.info.end_at_ms as i64;
        let id2 = id.to_string();
        self.store.call(move |s| s.set_end_at(&id2, end)).await?;
        if out.resumed {
            self.lifecycle(EventKind::Resumed, &row, serde_json::Map::new());
        }
        Ok(self.sandbox_body(&row, &out.info))
    }

    /// `POST /sandboxes/{id}/pause`: how long the sandbox was stopped and the size of
    /// its checkpoint.
    pub async fn pause(&self, team: &Team, id: &str, cmd: Pause) -> ApiResult<(Duration, u64)> {
        let (row, info) = self.owned_live(team, id).await?;
        if is_paused(info.state) {
            return Err(ApiError::Conflict(format!(
                "Error pausing sandbox - sandbox '{id}' is already paused"
            )));
        }
        let req = cubicle_node::PauseRequest {
            memory: cmd.memory,
            require_healthy_guest: cmd.require_healthy_guest,
        };
        self.sync_logs(id).await;
        match self.backend.pause(id, req).await {
            Ok(r) => {
                self.lifecycle(EventKind::Paused, &row, serde_json::Map::new());
                Ok((r.frozen, r.bytes))
            }
            Err(cubicle_node::Error::Envd(m)) => Err(ApiError::Unavailable(m)),
            Err(cubicle_node::Error::Conflict(m)) => {
                Err(ApiError::Conflict(format!("Error pausing sandbox - {m}")))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// `POST /sandboxes/{id}/snapshots`: the snapshot, how long the source was stopped
    /// and the checkpoint's size.
    pub async fn snapshot(
        &self,
        team: &Team,
        id: &str,
        cmd: CreateSnapshot,
    ) -> ApiResult<(SnapshotInfo, Duration, u64)> {
        self.owned(team, id).await?;
        let names: Vec<String> = cmd
            .name
            .iter()
            .map(|(n, tag)| format!("{}/{n}:{tag}", team.name))
            .collect();
        let report = self
            .backend
            .snapshot(
                id,
                cubicle_node::SnapshotRequest {
                    names: names.clone(),
                    owner: team.id.to_string(),
                    memory: cmd.memory,
                },
            )
            .await?;
        Ok((
            snapshot_info(&report.snapshot),
            report.frozen,
            report.snapshot.bytes,
        ))
    }

    /// `GET /snapshots`: one page of `team`'s snapshots (oldest first) and the next
    /// page's token.
    pub fn list_snapshots(
        &self,
        team: &Team,
        q: &ListSnapshots,
    ) -> ApiResult<(Vec<SnapshotInfo>, Option<String>)> {
        let owner = team.id.to_string();
        let mut all: Vec<cubicle_node::SnapshotRecord> = self
            .backend
            .snapshots()
            .into_iter()
            .filter(|s| s.owner == owner)
            .filter(|s| q.sandbox_id.as_ref().is_none_or(|id| &s.source == id))
            .filter(|s| {
                q.name
                    .as_ref()
                    .is_none_or(|n| snapshot_matches(s, n, &team.name))
            })
            .collect();
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        if let Some(tok) = &q.next_token {
            let (t, id) = crate::query::decode_cursor(tok)?;
            all.retain(|s| (s.created_at_ms as i64, s.id.as_str()) > (t, id.as_str()));
        }
        let more = all.len() > q.limit;
        all.truncate(q.limit);
        let next = match (more, all.last()) {
            (true, Some(s)) => Some(encode_cursor(s.created_at_ms as i64, &s.id)),
            _ => None,
        };
        Ok((all.iter().map(snapshot_info).collect(), next))
    }

    /// The snapshot of `team` that `name` refers to.
    pub(crate) fn team_snapshot(
        &self,
        team: &Team,
        name: &str,
    ) -> Option<cubicle_node::SnapshotRecord> {
        let name = if name.contains('%') {
            crate::query::unescape(name, false).ok()?
        } else {
            name.to_string()
        };
        let owner = team.id.to_string();
        self.backend
            .find_snapshot(&name)
            .or_else(|| self.backend.find_snapshot(&format!("{}/{name}", team.name)))
            .or_else(|| {
                (!name.contains(':'))
                    .then(|| {
                        self.backend
                            .find_snapshot(&format!("{}/{name}:default", team.name))
                    })
                    .flatten()
            })
            .filter(|s| s.owner == owner)
    }

    /// `DELETE /templates/{id}` of a snapshot: 204, or 404 when it is none of `team`'s.
    pub async fn delete_snapshot(&self, team: &Team, name: &str) -> ApiResult<()> {
        let snap = self
            .team_snapshot(team, name)
            .ok_or_else(|| ApiError::NotFound(format!("template '{name}' not found")))?;
        self.backend.delete_snapshot(&snap.id).await?;
        Ok(())
    }

    /// `POST /sandboxes/{id}/fork`: one entry per fork, in order.
    pub async fn fork(&self, team: &Team, id: &str, cmd: Fork) -> ApiResult<Vec<ForkResult>> {
        let (row, info) = self.owned_live(team, id).await?;
        if is_paused(info.state) {
            return Err(ApiError::Conflict(format!(
                "sandbox '{id}' is paused and cannot be forked; resume it first"
            )));
        }
        let results = self.backend.fork(id, cmd.count, cmd.timeout).await?;
        let mut out = Vec::new();
        for r in results {
            out.push(match r {
                Ok(child) => match self.register_child(team, &row, &child).await {
                    Ok(body) => ForkResult {
                        sandbox: Some(body),
                        error: None,
                    },
                    Err(e) => fork_error(e),
                },
                Err(e) => fork_error(e.into()),
            });
        }
        Ok(out)
    }

    /// Records a sandbox the node made from another (a fork) for `team`.
    async fn register_child(
        &self,
        team: &Team,
        parent: &SandboxRow,
        info: &SandboxInfo,
    ) -> ApiResult<Sandbox> {
        let row = SandboxRow {
            id: info.id.to_string(),
            team_id: team.id,
            template_id: parent.template_id.clone(),
            alias: parent.alias.clone(),
            metadata: info.metadata.clone(),
            env_var_names: parent.env_var_names.clone(),
            traffic_access_token: parent
                .traffic_access_token
                .is_some()
                .then(cubicle_node::ids::new_access_token),
            allow_internet: info.network.needs_network(),
            cpu_count: info.cpus,
            memory_mb: info.memory_mb,
            disk_mb: info.disk_mb,
            started_at: info.created_at_ms as i64,
            end_at: info.end_at_ms as i64,
            state: SandboxRowState::Running,
            death_reason: None,
            ended_at: None,
        };
        self.register_new(&row, &info.id).await?;
        let mut data = serde_json::Map::new();
        data.insert("source".into(), "fork".into());
        data.insert("parent".into(), parent.id.clone().into());
        self.lifecycle(EventKind::Created, &row, data);
        Ok(self.sandbox_body(&row, info))
    }

    /// `POST /sandboxes/{id}/rollback` (Cubicle's own): back to one of its snapshots.
    pub async fn rollback(&self, team: &Team, id: &str, cmd: Rollback) -> ApiResult<Sandbox> {
        let (row, _) = self.owned_live(team, id).await?;
        let snap = self.team_snapshot(team, &cmd.snapshot_id).ok_or_else(|| {
            ApiError::NotFound(format!("snapshot '{}' not found", cmd.snapshot_id))
        })?;
        self.backend.rollback(id, &snap.id).await?;
        let info = self.backend.peek(id)?;
        let end = info.end_at_ms as i64;
        let id2 = id.to_string();
        self.store.call(move |s| s.set_end_at(&id2, end)).await?;
        Ok(self.sandbox_body(&row, &info))
    }

    /// Resumes a paused sandbox of the API with auto-resume on (the router asks), with
    /// its create-time timeout. `None` if it is not one, or the resume failed.
    pub async fn auto_resume(&self, id: &str) -> Option<SandboxInfo> {
        let info = self.backend.peek(id).ok()?;
        if !is_paused(info.state) || !info.lifecycle.auto_resume || self.route(id).is_none() {
            return None;
        }
        let timeout = Duration::from_millis(info.timeout_ms.max(1000))
            .clamp(Duration::from_secs(1), self.config.limits.max_timeout);
        match self.backend.resume(id, timeout, true).await {
            Ok(out) => {
                let end = out.info.end_at_ms as i64;
                let id2 = id.to_string();
                let _ = self.store.call(move |s| s.set_end_at(&id2, end)).await;
                tracing::info!(sandbox = %id, took_us = out.took.as_micros() as u64, "sandbox resumed by a request");
                if out.resumed
                    && let Ok(Some(row)) = self.store.read(|s| s.sandbox(id))
                {
                    self.lifecycle(EventKind::Resumed, &row, serde_json::Map::new());
                }
                self.backend.peek(id).ok()
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, "auto-resume failed: {e}");
                None
            }
        }
    }

    // ---- list ----

    /// Live sandboxes of `team` matching `f`, one page, plus the next page's token.
    pub async fn list(
        &self,
        team: &Team,
        f: &ListFilter,
    ) -> ApiResult<(Vec<ListedSandbox>, Option<String>)> {
        let team_id = team.id;
        self.backend.refresh_all().await;
        let rows = self
            .store
            .call(move |s| s.running_sandboxes(Some(team_id)))
            .await?;
        let mut live = Vec::new();
        for row in rows {
            match self.backend.peek(&row.id) {
                Ok(info) if is_live(info.state) => live.push((row, info)),
                Err(e) if fate_unknown(&e) => {
                    tracing::debug!(sandbox = %row.id, "not listed: {e}");
                }
                other => self.mark_dead(&row.id, other.as_ref().ok()).await,
            }
        }
        live.retain(|(_, info)| {
            if is_paused(info.state) {
                f.paused
            } else {
                f.running
            }
        });
        live.retain(|(row, _)| {
            f.metadata
                .iter()
                .all(|(k, v)| row.metadata.get(k) == Some(v))
                && f.template
                    .as_ref()
                    .is_none_or(|t| &row.template_id == t || row.alias.as_ref() == Some(t))
                && f.started_after.is_none_or(|t| row.started_at >= t)
        });
        live.sort_by(|(a, _), (b, _)| (a.started_at, &a.id).cmp(&(b.started_at, &b.id)));
        if f.descending {
            live.reverse();
        }
        if let Some((t, id)) = &f.cursor {
            let key = (*t, id.as_str());
            live.retain(|(r, _)| {
                let k = (r.started_at, r.id.as_str());
                if f.descending { k < key } else { k > key }
            });
        }
        let more = live.len() > f.limit;
        live.truncate(f.limit);
        let next = match (more, live.last()) {
            (true, Some((r, _))) => Some(encode_cursor(r.started_at, &r.id)),
            _ => None,
        };
        let items = live
            .into_iter()
            .map(|(row, info)| self.listed(row, &info))
            .collect();
        Ok((items, next))
    }

    /// Records a sandbox the node just made (create, fork): its row, its route and the
    /// created hook. If the row cannot be written the sandbox is killed: never a sandbox
    /// nobody can see.
    async fn register_new(&self, row: &SandboxRow, id: &str) -> ApiResult<()> {
        let (r2, backend) = (row.clone(), self.backend.clone());
        if let Err(e) = self.store.call(move |s| backend.record_new(s, &r2)).await {
            let _ = self.backend.kill(id).await;
            return Err(e.into());
        }
        lock(&self.routes).insert(row.id.clone(), row.traffic_access_token.clone());
        Ok(())
    }

    /// A sandbox as E2B lists it (`ListedSandbox`), from its row and the node's view.
    pub(crate) fn listed(&self, row: SandboxRow, info: &SandboxInfo) -> ListedSandbox {
        ListedSandbox {
            template_id: row.template_id,
            sandbox_id: row.id,
            client_id: CLIENT_ID,
            started_at: format_time(row.started_at),
            end_at: format_time(end_at(info)),
            cpu_count: row.cpu_count,
            memory_mb: row.memory_mb,
            disk_size_mb: row.disk_mb,
            state: state_word(info.state),
            envd_version: ENVD_VERSION,
            alias: row.alias,
            metadata: row.metadata,
            envd_unresponsive_at_pause: info.envd_unresponsive_at_pause.then_some(true),
            volume_mounts: self.mount_bodies(&info.volumes),
        }
    }

    // ---- logs ----

    async fn sync_logs(&self, id: &str) {
        self.backend.fetch_log(id).await;
        let (logs, src, id) = (self.logs.clone(), self.backend.log_path(id), id.to_string());
        match logs.pending(&id, &src) {
            0 => {}
            // A few lines (the usual case): a handful of small file operations, cheaper
            // here than the hop to the blocking pool.
            n if n <= INLINE_LOG_SYNC => logs.sync(&id, &src),
            _ => drop(tokio::task::spawn_blocking(move || logs.sync(&id, &src)).await),
        }
    }

    /// Log lines of a sandbox of `team`: running, or ended but still retained.
    pub async fn logs(&self, team: &Team, id: &str) -> ApiResult<Vec<LogLine>> {
        if !plausible_id(id) {
            return Err(ApiError::sandbox_not_found(id));
        }
        let id2 = id.to_string();
        let row = self.store.call(move |s| s.sandbox(&id2)).await?;
        if row.is_none_or(|r| r.team_id != team.id) {
            return Err(ApiError::sandbox_not_found(id));
        }
        if lock(&self.routes).contains_key(id) {
            self.sync_logs(id).await;
        }
        let (logs, id2) = (self.logs.clone(), id.to_string());
        let mut lines = tokio::task::spawn_blocking(move || logs.read(&id2))
            .await
            .map_err(|e| ApiError::Internal(format!("log read task: {e}")))?;
        // The network audit trail, interleaved by time.
        let net = self.backend.network_log(id, 0, usize::MAX).await;
        if !net.is_empty() {
            lines.extend(net.iter().map(LogLine::network));
            lines.sort_by_key(|l| l.at_ms);
        }
        Ok(lines)
    }

    /// The network audit trail of a sandbox of `team` (running, or ended but retained):
    /// events after `after`, at most `limit`.
    pub async fn network_log(
        &self,
        team: &Team,
        id: &str,
        after: u64,
        limit: usize,
    ) -> ApiResult<Vec<cubicle_node::NetEvent>> {
        if !plausible_id(id) {
            return Err(ApiError::sandbox_not_found(id));
        }
        let id2 = id.to_string();
        let row = self.store.call(move |s| s.sandbox(&id2)).await?;
        if row.is_none_or(|r| r.team_id != team.id) {
            return Err(ApiError::sandbox_not_found(id));
        }
        Ok(self.backend.network_log(id, after, limit).await)
    }

    /// `PUT /sandboxes/{id}/network`: replace a running sandbox's egress policy.
    pub async fn update_network(
        &self,
        team: &Team,
        id: &str,
        cmd: crate::commands::UpdateNetwork,
    ) -> ApiResult<()> {
        self.owned(team, id).await?;
        self.backend.check_network(&cmd.network).await?;
        self.check_rule_secrets(team, &cmd.network)?;
        self.backend.update_network(id, cmd.network).await?;
        Ok(())
    }

    // ---- metrics ----

    /// `GET /sandboxes/{id}/metrics`: the samples taken with `start <= time <= end`
    /// (unix seconds; open ends: since the sandbox started, until now).
    pub async fn metrics(
        &self,
        team: &Team,
        id: &str,
        start: Option<i64>,
        end: Option<i64>,
    ) -> ApiResult<Vec<SandboxMetric>> {
        self.owned(team, id).await?;
        Ok(self.metrics.range(id, start, end))
    }

    /// `GET /sandboxes/metrics?sandbox_ids=…`: the latest sample (inside `start..=end`
    /// when given) of each of those that are the team's and alive; others are left out.
    pub async fn metrics_many(
        &self,
        team: &Team,
        ids: &[String],
        start: Option<i64>,
        end: Option<i64>,
    ) -> ApiResult<BTreeMap<String, SandboxMetric>> {
        let mut out = BTreeMap::new();
        for id in ids {
            if self.owned(team, id).await.is_ok()
                && let Some(m) = self.metrics.latest(id, start, end)
            {
                out.insert(id.clone(), m);
            }
        }
        Ok(out)
    }

    /// Samples the live sandboxes whose step elapsed (at most [`crate::metrics::BUDGET`]
    /// per call), on the blocking pool: cgroup counters and the disk quota.
    pub async fn sample_metrics(self: &Arc<Self>) {
        let ids: HashSet<String> = lock(&self.routes).keys().cloned().collect();
        self.metrics.retain(&ids);
        let due = self.metrics.due(ids, now_ms());
        if due.is_empty() {
            return;
        }
        let cp = self.clone();
        let _ = tokio::task::spawn_blocking(move || {
            for id in due {
                let Ok(info) = cp.backend.peek(&id) else {
                    continue;
                };
                if info.state != SandboxState::Running {
                    continue;
                }
                if let Ok(stats) = cp.backend.stats(&id) {
                    let shape = Shape {
                        created_at_ms: info.created_at_ms as i64,
                        cpus: info.cpus,
                        mem_total: info.memory_mb << 20,
                        disk_total: info.disk_mb << 20,
                    };
                    cp.metrics.record(&id, shape, now_ms(), &stats);
                }
            }
        })
        .await;
    }

    // ---- background upkeep ----

    /// One pass: record deaths the node noticed, mirror the logs that grew, purge old
    /// records.
    pub async fn upkeep(&self, purge: bool) {
        let ids: Vec<String> = lock(&self.routes).keys().cloned().collect();
        let mut marks = std::mem::take(&mut *lock(&self.log_marks));
        let mut grown = self.backend.grown_logs(&mut marks).await;
        *lock(&self.log_marks) = marks;
        let waiting = std::mem::take(&mut *lock(&self.logs_waiting));
        if let Some(g) = grown.as_mut() {
            g.extend(waiting);
        }
        let mut still_waiting = HashSet::new();
        for id in ids {
            match self.backend.peek(&id) {
                Ok(info) if is_live(info.state) => {
                    if grown.as_ref().is_some_and(|g| !g.contains(&id)) {
                        // Its log did not grow.
                    } else if info.state != SandboxState::Paused {
                        self.sync_logs(&id).await;
                    } else {
                        still_waiting.insert(id);
                    }
                }
                Err(e) if fate_unknown(&e) => {}
                other => self.mark_dead(&id, other.as_ref().ok()).await,
            }
        }
        lock(&self.logs_waiting).extend(still_waiting);
        if purge {
            let before = now_ms() - self.config.retention.as_millis() as i64;
            match self.store.call(move |s| s.purge_ended(before)).await {
                Ok(ids) => {
                    for id in ids {
                        self.logs.remove(&id);
                        self.backend.forget_log(&id);
                        self.backend.forget_network_log(&id);
                    }
                }
                Err(e) => tracing::warn!("purging old sandbox records: {e}"),
            }
            self.events.purge().await;
        }
    }

    /// Run [`ControlPlane::upkeep`] every `period` until the control plane is dropped.
    pub fn spawn_upkeep(self: &Arc<Self>, period: Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut n: u64 = 0;
            loop {
                tokio::time::sleep(period).await;
                let Some(cp) = weak.upgrade() else { return };
                cp.upkeep(n.is_multiple_of(60)).await;
                cp.sample_metrics().await;
                n += 1;
            }
        })
    }
}

/// Alive as far as the API is concerned: running, being created, pausing or paused.
fn is_live(state: SandboxState) -> bool {
    matches!(
        state,
        SandboxState::Running
            | SandboxState::Creating
            | SandboxState::Pausing
            | SandboxState::Paused
    )
}

/// Paused, or on its way (E2B shows a pausing sandbox as paused).
fn is_paused(state: SandboxState) -> bool {
    matches!(state, SandboxState::Pausing | SandboxState::Paused)
}

/// `state` of a detail or list item: exactly `running` or `paused`.
fn state_word(state: SandboxState) -> &'static str {
    if is_paused(state) {
        "paused"
    } else {
        "running"
    }
}

/// `endAt`: the end time, or the time of the pause for a paused sandbox.
fn end_at(info: &SandboxInfo) -> i64 {
    match (is_paused(info.state), info.paused_at_ms) {
        (true, Some(t)) => t as i64,
        _ => info.end_at_ms as i64,
    }
}

fn lifecycle(info: &SandboxInfo) -> Lifecycle {
    Lifecycle {
        auto_resume: info.lifecycle.auto_resume,
        on_timeout: if info.lifecycle.auto_pause {
            "pause"
        } else {
            "kill"
        },
    }
}

/// `SnapshotInfo` of a snapshot: named ones by their (first) name, others by
/// `<id>:default`.
fn snapshot_info(s: &cubicle_node::SnapshotRecord) -> SnapshotInfo {
    SnapshotInfo {
        snapshot_id: s
            .names
            .first()
            .cloned()
            .unwrap_or_else(|| format!("{}:default", s.id)),
        names: s.names.clone(),
    }
}

/// The `name` filter of `GET /snapshots`: an id, `name` (any tag) or `name:tag`, with or
/// without the team's namespace.
fn snapshot_matches(s: &cubicle_node::SnapshotRecord, name: &str, team: &str) -> bool {
    if s.answers_to(name) {
        return true;
    }
    let full = if name.contains('/') {
        name.to_string()
    } else {
        format!("{team}/{name}")
    };
    s.names.iter().any(|n| {
        n == &full
            || (!full.contains(':')
                && n.split_once(':').map(|(base, _)| base) == Some(full.as_str()))
    })
}

fn fork_error(e: ApiError) -> ForkResult {
    ForkResult {
        sandbox: None,
        error: Some(ForkError {
            code: e.status().as_u16(),
            message: e.to_string(),
        }),
    }
}
