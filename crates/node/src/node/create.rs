//! The create path: check the request ([`Inner::plan_create`]), then, when no pool serves
//! it, create cold ([`Inner::create_cold`]): reserve a slot and record, prepare the
//! sandbox's directory (quota, `ctl/`, `/etc` files), start it through the runtime, wait
//! for envd's `/health` ([`Inner::start_phase`], which pool refills use too), POST
//! `/init`, run the template's start command and readiness probe, mark it `running`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cubicle_runtime::SandboxId;

use super::inner::{Inner, birth_env, blocking, init_after_birth, sandbox_env};
use super::teardown::spawn_watcher;
use super::{ENVD_IN_SANDBOX, ENVD_SOCKET};
use crate::envd_client::EnvdClient;
use crate::error::{Error, IoContext, Result};
use crate::node::idle_conn::IDLE_CONN_TTL;
use crate::runtime::StartSpec;
use crate::sandbox::{CreateRequest, DeathReason, SandboxInfo, SandboxRecord, SandboxState};
use crate::slots::IDS_PER_SANDBOX;
use crate::template::Template;
use crate::{fsutil, ids, procfs};

/// A checked create request: what [`Inner::try_claim`] and [`Inner::create_cold`] get.
pub(crate) struct CreatePlan {
    pub(crate) template: Template,
    pub(crate) id: SandboxId,
    /// Memory (MiB), CPUs, disk (MiB).
    pub(crate) limits: (u64, u32, u64),
    pub(crate) timeout: Duration,
}

impl Inner {
    /// What a create asks for, checked: the template (built on first use of a built-in),
    /// the id (the caller's, or a new one), the limits, the timeout.
    pub(crate) async fn plan_create(&self, req: &CreateRequest) -> Result<CreatePlan> {
        let template = self.resolve_template(&req.template).await?;
        self.plan_with(req, template)
    }

    /// The template a create names (`name` or `name:tag`), built first if it is a
    /// built-in that is not built yet.
    async fn resolve_template(&self, reference: &str) -> Result<Template> {
        let inner = self;
        if let Some((name, tag)) = reference.split_once(':') {
            return inner
                .templates
                .get_tagged(name, Some(tag))?
                .ok_or_else(|| crate::template::Error::TemplateNotFound(reference.into()).into());
        }
        // A built template is one small file read, done inline; building one (a first
        // use of a built-in) goes to the blocking pool.
        let template = match inner.templates.get(reference)? {
            Some(t) => t,
            // Not here: published by another node? (Only with an object store.)
            None if inner.object_store().is_some()
                && inner.pull_template(reference).await?.is_some() =>
            {
                inner
                    .templates
                    .get(reference)?
                    .ok_or_else(|| crate::template::Error::TemplateNotFound(reference.into()))?
            }
            None => {
                let store = inner.templates.clone();
                let name = reference.to_string();
                let progress = inner.config.template_progress;
                tokio::task::spawn_blocking(move || store.ensure(&name, progress))
                    .await
                    .map_err(|e| Error::Runtime(format!("template task: {e}")))??
            }
        };
        Ok(template)
    }

    /// [`Inner::plan_create`] for a template value (e.g. a build step's layer stack).
    pub(crate) fn plan_with(&self, req: &CreateRequest, template: Template) -> Result<CreatePlan> {
        let inner = self;
        let id = match &req.id {
            Some(id) if let Ok(id) = SandboxId::parse(id) => id,
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
        crate::volume::check_mounts(&req.volumes)?;
        // Every volume must exist now (a missing one is the caller's error, not a
        // failed start).
        inner.volume_binds(&req.volumes)?;
        let timeout = req.timeout.unwrap_or(inner.config.default_timeout);
        Ok(CreatePlan {
            template,
            id,
            limits: (memory_mb, cpus, disk_mb),
            timeout,
        })
    }

    /// A create that no pool served: reserve, start, `/init`; on failure everything it
    /// made is torn down again. `turn`: its place among cold creates and refills, if it
    /// has one already (else it waits for one).
    pub(crate) async fn create_cold(
        self: &Arc<Self>,
        req: &CreateRequest,
        plan: CreatePlan,
        t0: Instant,
        turn: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<SandboxInfo> {
        let inner = self;
        let CreatePlan {
            template,
            id,
            limits: (memory_mb, cpus, disk_mb),
            timeout,
        } = plan;
        // Cold: bounded concurrency (fair FIFO semaphore), shared with pool refills.
        let _permit = match turn {
            Some(p) => Some(p),
            None => inner.pool.create_permits.clone().acquire_owned().await.ok(),
        };
        let env_vars = sandbox_env(&template, &req.env_vars, &id);
        let kept = inner.make_room().await;
        let record = inner.reserve(&id, &template, kept, |r| {
            r.end_at_ms = r.created_at_ms + timeout.as_millis() as u64;
            (r.memory_mb, r.cpus, r.disk_mb) = (memory_mb, cpus, disk_mb);
            r.internet = req.internet;
            r.network = req.network.clone();
            r.mask_request_host = req.mask_request_host.clone();
            r.env_vars = env_vars;
            r.metadata = req.metadata.clone();
            r.lifecycle = req.lifecycle;
            r.timeout_ms = timeout.as_millis() as u64;
            r.volumes = req.volumes.clone();
        })?;

        match self.bring_up(record, &template, t0).await {
            Ok(info) => Ok(info),
            Err(e) => {
                tracing::warn!(sandbox = %id, "create failed: {e}");
                let reason = {
                    let st = inner.lock();
                    st.live().get(&id).and_then(|l| l.kill_requested)
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
        self: &Arc<Self>,
        record: SandboxRecord,
        template: &Template,
        t0: Instant,
    ) -> Result<SandboxInfo> {
        let dir = self.sandbox_dir(&record.id);
        let (record, started, [t_prep, t_spawn, t_health]) =
            self.start_sandbox(record, template, t0).await?;
        let pid = started.pid;
        self.init_sandbox(
            record, template, t0, started, pid, &dir, t_prep, t_spawn, t_health,
        )
        .await
    }

    /// First half of a create (also a pool refill): directory, quota, spawn, envd healthy.
    pub(crate) async fn start_phase(
        self: &Arc<Self>,
        record: SandboxRecord,
        template: &Template,
        t0: Instant,
    ) -> Result<SandboxRecord> {
        Ok(self.start_sandbox(record, template, t0).await?.0)
    }

    async fn start_sandbox(
        self: &Arc<Self>,
        mut record: SandboxRecord,
        template: &Template,
        t0: Instant,
    ) -> Result<(SandboxRecord, crate::runtime::Started, [Duration; 3])> {
        let inner = self;
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
        let spec = self.prepare_sandbox_dir(&record, template)?;
        let t_prep = t0.elapsed();
        let rt = inner.runtime.clone();
        let started = blocking(move || rt.start(&spec)).await?;
        let t_spawn = t0.elapsed();
        record.pid = Some(started.pid);
        record.pid_start_time = procfs::start_time(started.pid);
        record.runtime = started.state.clone();
        fsutil::rewrite_json(&dir.join("sandbox.json"), &record)?;
        self.update_record(&record)?;

        let client = EnvdClient::new(inner.envd_socket(&id), None);
        let (pid, pst) = (started.pid, record.pid_start_time);
        let conn = client
            .wait_ready(inner.config.envd_ready_timeout, move || {
                procfs::is_alive(pid, pst)
            })
            .await?;
        // For an `/init` if envd needs one (a cold create's now, a pooled one's at its
        // claim), and then for the sandbox's first request.
        inner.keep_envd_conn(&id, conn, None);
        let t_health = t0.elapsed();
        Ok((record, started, [t_prep, t_spawn, t_health]))
    }

    /// Second half of a cold create: `/init`, start command, readiness, `running`.
    #[allow(clippy::too_many_arguments)]
    async fn init_sandbox(
        self: &Arc<Self>,
        mut record: SandboxRecord,
        template: &Template,
        t0: Instant,
        started: crate::runtime::Started,
        pid: i32,
        dir: &Path,
        t_prep: Duration,
        t_spawn: Duration,
        t_health: Duration,
    ) -> Result<SandboxInfo> {
        let inner = self;
        let id = record.id.clone();
        // envd was born knowing all of it (`birth_env`) unless the environment was too
        // large for that; then `/init` tells it.
        let init = init_after_birth(&record);
        inner.init_envd(&record, init, Some(IDLE_CONN_TTL)).await?;
        inner
            .start_template_command(&record, template, started.pid)
            .await?;
        record.state = SandboxState::Running;
        fsutil::rewrite_json(&dir.join("sandbox.json"), &record)?;
        let ready_us = t0.elapsed().as_micros() as u64;
        let info = {
            let mut st = inner.lock();
            let live = st
                .live_mut()
                .get_mut(&id)
                .ok_or_else(|| Error::SandboxNotFound(id.to_string()))?;
            if let Some(reason) = live.kill_requested {
                return Err(Error::Runtime(format!(
                    "sandbox {id} was killed during creation ({reason})"
                )));
            }
            live.record = record.clone();
            live.ready_us = ready_us;
            live.init = inner.init_pidfd(&id, pid, record.pid_start_time);
            live.watcher = Some(spawn_watcher(
                Arc::downgrade(inner),
                id.clone(),
                live.init.as_ref(),
            ));
            live.info(inner.envd_socket(&id))
        };
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
        Ok(info)
    }

    /// Starts the template's start command (if any) through envd, as the template's
    /// start user, and waits for its readiness port (if any): part of a cold create, and
    /// of a pool refill for templates with a start command. `record.access_token` is the
    /// token envd was given (empty: none yet).
    pub(crate) async fn start_template_command(
        &self,
        record: &SandboxRecord,
        template: &Template,
        init_pid: i32,
    ) -> Result<()> {
        let id = &record.id;
        let mut start_command = None;
        if let Some(cmd) = template
            .config
            .start_command
            .as_deref()
            .filter(|c| !c.trim().is_empty())
        {
            // Started in the background (its failure to start fails the create).
            let token = Some(record.access_token.clone()).filter(|t| !t.is_empty());
            let authed = EnvdClient::new(self.envd_socket(id), token);
            let spec = crate::envd_client::ProcessSpec {
                cmd: "/bin/sh".into(),
                args: vec!["-c".into(), cmd.to_string()],
                user: template.config.start_user.clone(),
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
            let (spid, pst) = (init_pid, record.pid_start_time);
            let exit_code = start_command.as_ref().map(|w| w.exit_code());
            let r = blocking(move || {
                crate::ready::wait_http_health(
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
        if let Some(ready) = template
            .config
            .ready_command
            .as_deref()
            .filter(|c| !c.trim().is_empty())
        {
            // E2B's readyCmd: run (as the default user) until it exits 0.
            let token = Some(record.access_token.clone()).filter(|t| !t.is_empty());
            let authed = EnvdClient::new(self.envd_socket(id), token);
            let exit_code = start_command.as_ref().map(|w| w.exit_code());
            let r =
                crate::ready::wait_ready_command(&authed, ready, Duration::from_secs(120), || {
                    let failed = exit_code.as_ref().and_then(|f| f()).filter(|c| *c != 0);
                    failed.map(|code| format!("the start command failed (exit code {code})"))
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
        Ok(())
    }

    /// Fills sandbox `record`'s (existing) directory for a start: mode, a fresh `ctl/`,
    /// `sandbox.json`, `/etc/hosts` and `/etc/resolv.conf`; returns what the runtime
    /// needs to start it (or to restore it there).
    pub(crate) fn prepare_sandbox_dir(
        &self,
        record: &SandboxRecord,
        template: &Template,
    ) -> Result<StartSpec> {
        let id = &record.id;
        let dir = self.sandbox_dir(id);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))
            .ctx("chmod", &dir)?;
        let ctl = dir.join("ctl");
        if ctl.exists() {
            // A copy of another sandbox's directory: its socket is stale.
            fsutil::remove_tree(&ctl)?;
        }
        std::fs::create_dir_all(&ctl).ctx("mkdir", &ctl)?;
        give_to_sandbox_root(&ctl, record.uid_base)?;
        std::fs::set_permissions(&ctl, std::fs::Permissions::from_mode(0o700))
            .ctx("chmod", &ctl)?;
        fsutil::rewrite_json(&dir.join("sandbox.json"), record)?;
        if crate::pool::shell::is_shell(template) {
            // Its files and mounts come with its template's root (`pool/shell.rs`).
            return Ok(self.start_spec(record, template, Vec::new(), Vec::new()));
        }
        let (binds, volumes) = self.template_binds(record, template)?;
        Ok(self.start_spec(record, template, binds, volumes))
    }

    /// Writes sandbox `record`'s `/etc/hosts` and `/etc/resolv.conf` (and the egress CA
    /// in `template`'s bundle) to its directory; returns its bind mounts (those files,
    /// the code interpreter's, the template's own) and its volumes.
    #[allow(clippy::type_complexity)]
    pub(crate) fn template_binds(
        &self,
        record: &SandboxRecord,
        template: &Template,
    ) -> Result<(Vec<(PathBuf, PathBuf, bool)>, Vec<(PathBuf, PathBuf, bool)>)> {
        let dir = self.sandbox_dir(&record.id);
        let mut binds = write_etc_files(&dir, &record.id, record.uid_base)?;
        if let Some(ca) = self.runtime.egress().and_then(|e| e.ca_pem()) {
            binds.extend(write_ca_bundle(&dir, &template.rootfs, &ca)?);
        }
        binds.extend(crate::template::code_interpreter::bind_for(
            &template.config,
        ));
        binds.extend(
            template
                .binds
                .iter()
                .map(|(s, t)| (s.clone(), t.clone(), true)),
        );
        Ok((binds, self.volume_binds(&record.volumes)?))
    }

    /// What the runtime needs to start (or restore) sandbox `record` on `template`.
    pub(crate) fn start_spec(
        &self,
        record: &SandboxRecord,
        template: &Template,
        binds: Vec<(PathBuf, PathBuf, bool)>,
        volumes: Vec<(PathBuf, PathBuf, bool)>,
    ) -> StartSpec {
        let id = record.id.clone();
        StartSpec {
            rootfs: template.rootfs.clone(),
            layers: template.layers.clone(),
            sandbox_dir: self.sandbox_dir(&id),
            slot: record.slot,
            uid_base: record.uid_base,
            uid_count: IDS_PER_SANDBOX,
            memory_mb: record.memory_mb,
            cpus: record.cpus,
            pids: self.config.pids_limit,
            disk_mb: record.disk_mb,
            internet: record.internet,
            network: record.network.clone(),
            hostname: id.to_string(),
            envd_binary: self.config.envd_binary.clone(),
            init: {
                let mut argv = vec![
                    ENVD_IN_SANDBOX.into(),
                    "--init".into(),
                    "--unix-socket-fd".into(),
                    cubicle_runtime::LISTEN_FD.to_string(),
                    // envd answers the node on its Unix socket; on TCP only inside the
                    // sandbox (loopback), never on the sandbox's address, which the host
                    // can route to.
                    "--listen".into(),
                    "127.0.0.1".into(),
                    "--default-user".into(),
                    record.default_user.clone(),
                ];
                if let Some(w) = &record.default_workdir {
                    argv.extend(["--default-workdir".into(), w.clone()]);
                }
                argv
            },
            env: birth_env(template, record),
            binds,
            volumes,
            ctl_socket: ENVD_SOCKET.into(),
            shell: crate::pool::shell::is_shell(template),
            id,
        }
    }

    pub(crate) fn update_record(&self, record: &SandboxRecord) -> Result<()> {
        let mut st = self.lock();
        let live = st
            .live_mut()
            .get_mut(&record.id)
            .ok_or_else(|| Error::SandboxNotFound(record.id.to_string()))?;
        if let Some(reason) = live.kill_requested {
            return Err(Error::Runtime(format!(
                "sandbox {} was killed during creation ({reason})",
                record.id
            )));
        }
        live.record = record.clone();
        Ok(())
    }
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

/// The sandbox's system CA bundle (Debian's path), and the file in the sandbox's
/// directory bound over it.
pub(crate) const CA_BUNDLE_TARGET: &str = "/etc/ssl/certs/ca-certificates.crt";
pub(crate) const CA_BUNDLE_FILE: &str = "ca-certificates.crt";

/// The template's CA bundle plus the node's egress CA (`ca_pem`), so that the sandbox
/// trusts the certificates the egress proxy presents for domains with header rules
/// (docs/network.md). Nothing when the template has no bundle at that path.
fn write_ca_bundle(
    dir: &Path,
    rootfs: &Path,
    ca_pem: &str,
) -> Result<Vec<(PathBuf, PathBuf, bool)>> {
    let template_bundle = rootfs.join(CA_BUNDLE_TARGET.trim_start_matches('/'));
    let Ok(mut bundle) = std::fs::read_to_string(&template_bundle) else {
        return Ok(Vec::new());
    };
    if !bundle.ends_with('\n') {
        bundle.push('\n');
    }
    bundle.push_str("# Cubicle node egress CA (header rules)\n");
    bundle.push_str(ca_pem);
    let p = dir.join(CA_BUNDLE_FILE);
    std::fs::write(&p, bundle).ctx("write", &p)?;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).ctx("chmod", &p)?;
    Ok(vec![(p, PathBuf::from(CA_BUNDLE_TARGET), false)])
}

/// chown `path` to the sandbox's root (host uid/gid `uid_base`). Only root can; without
/// root (unit tests with a fake runtime) the file stays ours.
fn give_to_sandbox_root(path: &Path, uid_base: u32) -> Result<()> {
    if !cubicle_syscalls::is_root() {
        return Ok(());
    }
    std::os::unix::fs::chown(path, Some(uid_base), Some(uid_base)).ctx("chown", path)
}
