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

use crate::backend::Backend;
use crate::commands::{
    Connect, CreateSandbox, Idempotency, Limits, ListFilter, Refresh, SetTimeout,
};
use crate::error::{ApiError, ApiResult};
use crate::logs::{LogLine, LogMirror};
use crate::metrics::{MetricsHistory, Shape};
use crate::model::{
    CLIENT_ID, ENVD_VERSION, Lifecycle, ListedSandbox, Network, Sandbox, SandboxDetail,
    SandboxMetric,
};
use crate::query::{encode_cursor, format_time};

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
}

impl ApiConfig {
    /// Defaults: 300 s default timeout, 24 h max, logs in `logs_dir`, 24 h retention.
    pub fn new(logs_dir: PathBuf) -> Self {
        ApiConfig {
            limits: Limits {
                default_timeout: Duration::from_secs(300),
                max_timeout: Duration::from_secs(24 * 3600),
            },
            domain: None,
            registry: Default::default(),
            logs_dir,
            retention: Duration::from_secs(24 * 3600),
            keyring: Arc::new(crate::keyring::Keyring::ephemeral()),
            volumes: crate::volumes::VolumeLimits::default(),
        }
    }
}

/// A sandbox id can only be one of ours if it looks like one.
fn plausible_id(id: &str) -> bool {
    cubicle_node::ids::is_valid_sandbox_id(id)
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
    /// Called with the id of every sandbox a create hands out (see [`ControlPlane::on_created`]).
    on_created: std::sync::OnceLock<CreatedHook>,
    /// Template builds (E2B's builder API).
    pub(crate) builds: crate::template_builds::Builds,
}

/// See [`ControlPlane::on_created`].
pub type CreatedHook = Box<dyn Fn(&str) + Send + Sync>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ControlPlane {
    /// Sets the function called (on the request's task, before the answer is sent) with
    /// the id of each sandbox a create hands out; `cubicle serve` uses it to open the
    /// router's connection to the new sandbox while the client reads the answer. Only
    /// the first call takes effect.
    pub fn on_created(&self, hook: CreatedHook) {
        let _ = self.on_created.set(hook);
    }

    /// Set up over a node and a store: sandboxes the store thinks are running are
    /// checked against the node (adopted if alive, recorded as ended otherwise).
    pub async fn open(
        backend: Arc<dyn Backend>,
        store: Store,
        config: ApiConfig,
    ) -> ApiResult<Arc<Self>> {
        let cp = Arc::new(ControlPlane {
            logs: Arc::new(LogMirror::new(config.logs_dir.clone())),
            backend,
            store,
            config,
            routes: Mutex::new(HashMap::new()),
            metrics: MetricsHistory::default(),
            on_created: std::sync::OnceLock::new(),
            builds: Default::default(),
        });
        let rows = cp.store.call(|s| s.running_sandboxes(None)).await?;
        for row in rows {
            match cp.backend.peek(&row.id) {
                Ok(info) if info.state == SandboxState::Running => {
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

    /// The node.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Ids of live API sandboxes with their traffic tokens.
    pub fn routes(&self) -> Vec<(String, Option<String>)> {
        lock(&self.routes)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The traffic token of a live API sandbox (`None` = unknown to the API).
    pub fn route(&self, id: &str) -> Option<Option<String>> {
        lock(&self.routes).get(id).cloned()
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
        let found = self
            .store
            .read(|s| s.find_key(key))?
            .ok_or_else(|| ApiError::Unauthorized("Invalid API key".into()))?;
        if found.use_is_stale(cubicle_store::now_ms()) {
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
        // Inline: reads one small file (no hop to the blocking pool on every create).
        let visible = self
            .backend
            .template_owner(&cmd.template.name)
            .is_none_or(|o| o == team.id.to_string());
        if !visible || !self.backend.template_exists(&cmd.template.node_ref())? {
            return Err(ApiError::NotFound(format!(
                "template '{}' not found (built-in templates: base, tiny; build others with `cubicle template build`)",
                cmd.template.requested
            )));
        }
        self.backend.check_network(&cmd.network).await?;
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
        let result = self.create_claimed(team, cmd).await;
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

    async fn create_claimed(&self, team: &Team, cmd: CreateSandbox) -> ApiResult<Sandbox> {
        let env_var_names: Vec<String> = cmd.env_vars.keys().cloned().collect();
        let volumes = self.resolve_mounts(team, &cmd.volume_mounts)?;
        let info = self
            .backend
            .create(CreateRequest {
                template: cmd.template.node_ref(),
                id: None,
                env_vars: cmd.env_vars,
                memory_mb: None,
                cpus: None,
                disk_mb: None,
                internet: cmd.internet,
                network: cmd.network,
                mask_request_host: cmd.mask_request_host,
                timeout: Some(cmd.timeout),
                metadata: cmd.metadata.clone(),
                volumes,
            })
            .await?;
        let row = SandboxRow {
            id: info.id.clone(),
            team_id: team.id,
            template_id: info.template.clone(),
            alias: Some(info.template.clone()),
            metadata: cmd.metadata,
            env_var_names,
            traffic_access_token: cmd
                .private_traffic
                .then(cubicle_node::ids::new_access_token),
            allow_internet: info.internet,
            cpu_count: info.cpus,
            memory_mb: info.memory_mb,
            disk_mb: info.disk_mb,
            started_at: info.created_at_ms as i64,
            end_at: info.end_at_ms as i64,
            state: SandboxRowState::Running,
            death_reason: None,
            ended_at: None,
        };
        let r2 = row.clone();
        if let Err(e) = self.store.call(move |s| s.insert_sandbox(&r2)).await {
            // Never leave a sandbox nobody can see.
            let _ = self.backend.kill(&info.id).await;
            return Err(e.into());
        }
        lock(&self.routes).insert(row.id.clone(), row.traffic_access_token.clone());
        if let Some(hook) = self.on_created.get() {
            hook(&row.id);
        }
        tracing::info!(sandbox = %row.id, team = %team.name, template = %row.template_id, "sandbox created");
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
        lock(&self.routes).remove(id);
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

    /// A running sandbox of `team`, or 404.
    pub async fn owned(&self, team: &Team, id: &str) -> ApiResult<(SandboxRow, SandboxInfo)> {
        if !plausible_id(id) {
            return Err(ApiError::sandbox_not_found(id));
        }
        let row = self.store.read(|s| s.sandbox(id))?;
        let Some(row) = row.filter(|r| r.team_id == team.id && r.state == SandboxRowState::Running)
        else {
            return Err(ApiError::sandbox_not_found(id));
        };
        match self.backend.peek(id) {
            Ok(info) if matches!(info.state, SandboxState::Running | SandboxState::Creating) => {
                Ok((row, info))
            }
            other => {
                self.mark_dead(id, other.as_ref().ok()).await;
                Err(ApiError::sandbox_not_found(id))
            }
        }
    }

    /// `GET /sandboxes/{id}`.
    pub async fn detail(&self, team: &Team, id: &str) -> ApiResult<SandboxDetail> {
        let (row, info) = self.owned(team, id).await?;
        Ok(SandboxDetail {
            template_id: row.template_id.clone(),
            sandbox_id: row.id.clone(),
            client_id: CLIENT_ID,
            started_at: format_time(row.started_at),
            end_at: format_time(info.end_at_ms as i64),
            envd_version: ENVD_VERSION,
            cpu_count: row.cpu_count,
            memory_mb: row.memory_mb,
            disk_size_mb: row.disk_mb,
            state: "running",
            alias: row.alias.clone(),
            envd_access_token: info.access_token.clone(),
            allow_internet_access: !info.network.deny_all(),
            domain: self.config.domain.clone(),
            metadata: row.metadata.clone(),
            network: Network::of(
                &info.network,
                row.traffic_access_token.is_none(),
                info.mask_request_host.clone(),
            ),
            lifecycle: Lifecycle {
                auto_resume: false,
                on_timeout: "kill",
            },
            volume_mounts: self.mount_bodies(&info.volumes),
        })
    }

    /// `DELETE /sandboxes/{id}`.
    pub async fn kill(self: &Arc<Self>, team: &Team, id: &str) -> ApiResult<()> {
        self.owned(team, id).await?;
        // Keep the last lines: the node deletes the log with the sandbox.
        self.sync_logs(id).await;
        match self.backend.kill(id).await {
            // NotFound: it died on its own meanwhile; either way it is gone now.
            Ok(()) | Err(cubicle_node::Error::SandboxNotFound(_)) => {
                // Gone for the router and the node now; the database row follows in the
                // background (a request that reads it meanwhile still asks the node, and
                // after a crash the startup check records the end).
                lock(&self.routes).remove(id);
                let info = self.backend.peek(id).ok();
                let (cp, id) = (self.clone(), id.to_string());
                tokio::spawn(async move { cp.mark_dead(&id, info.as_ref()).await });
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn apply_end(&self, id: &str, timeout: Duration, extend_only: bool) -> ApiResult<()> {
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
        }
        Ok(())
    }

    /// `POST /sandboxes/{id}/timeout`.
    pub async fn set_timeout(&self, team: &Team, id: &str, cmd: SetTimeout) -> ApiResult<()> {
        self.owned(team, id).await?;
        self.apply_end(id, cmd.timeout, false).await
    }

    /// `POST /sandboxes/{id}/refreshes`.
    pub async fn refresh(&self, team: &Team, id: &str, cmd: Refresh) -> ApiResult<()> {
        self.owned(team, id).await?;
        self.apply_end(id, cmd.duration, true).await
    }

    /// `POST /v2/sandboxes/{id}/connect` (and v1): running → extend, 200.
    pub async fn connect(&self, team: &Team, id: &str, cmd: Connect) -> ApiResult<Sandbox> {
        let (row, info) = self.owned(team, id).await?;
        self.apply_end(id, cmd.timeout, true).await?;
        Ok(self.sandbox_body(&row, &info))
    }

    // ---- list ----

    /// Live sandboxes of `team` matching `f`, one page, plus the next page's token.
    pub async fn list(
        &self,
        team: &Team,
        f: &ListFilter,
    ) -> ApiResult<(Vec<ListedSandbox>, Option<String>)> {
        let team_id = team.id;
        let rows = self
            .store
            .call(move |s| s.running_sandboxes(Some(team_id)))
            .await?;
        let mut live = Vec::new();
        for row in rows {
            match self.backend.peek(&row.id) {
                Ok(info)
                    if matches!(info.state, SandboxState::Running | SandboxState::Creating) =>
                {
                    live.push((row, info))
                }
                other => self.mark_dead(&row.id, other.as_ref().ok()).await,
            }
        }
        if !f.running {
            // Only paused ones asked for: Cubicle cannot pause yet.
            return Ok((Vec::new(), None));
        }
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
            .map(|(row, info)| ListedSandbox {
                template_id: row.template_id.clone(),
                sandbox_id: row.id.clone(),
                client_id: CLIENT_ID,
                started_at: format_time(row.started_at),
                end_at: format_time(info.end_at_ms as i64),
                cpu_count: row.cpu_count,
                memory_mb: row.memory_mb,
                disk_size_mb: row.disk_mb,
                state: "running",
                envd_version: ENVD_VERSION,
                alias: row.alias,
                metadata: row.metadata,
                volume_mounts: self.mount_bodies(&info.volumes),
            })
            .collect();
        Ok((items, next))
    }

    // ---- logs ----

    async fn sync_logs(&self, id: &str) {
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

    /// One pass: record deaths the node noticed, mirror logs, purge old records.
    pub async fn upkeep(&self, purge: bool) {
        let ids: Vec<String> = lock(&self.routes).keys().cloned().collect();
        for id in ids {
            match self.backend.peek(&id) {
                Ok(info)
                    if matches!(info.state, SandboxState::Running | SandboxState::Creating) =>
                {
                    self.sync_logs(&id).await;
                }
                other => {
                    if let Ok(i) = &other {
                        tracing::info!(sandbox = %id, reason = ?i.death_reason, "sandbox ended");
                    }
                    self.mark_dead(&id, other.as_ref().ok()).await
                }
            }
        }
        if purge {
            let before = now_ms() - self.config.retention.as_millis() as i64;
            match self.store.call(move |s| s.purge_ended(before)).await {
                Ok(ids) => {
                    for id in ids {
                        self.logs.remove(&id);
                        self.backend.forget_network_log(&id);
                    }
                }
                Err(e) => tracing::warn!("purging old sandbox records: {e}"),
            }
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
