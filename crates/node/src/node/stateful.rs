//! Stateful sandboxes: pause and resume (with or without memory), snapshots, sandboxes
//! made from a snapshot, forks and rollback. The runtime does the kernel work
//! (`SandboxRuntime::checkpoint`/`restore`, copy-on-write storage); this file keeps the
//! node's records, slots and states right around it:
//!
//! - A sandbox being paused, resumed, snapshotted or rolled back is *busy*: a second such
//!   operation or the reaper gets a conflict instead of racing it; a kill waits for it
//!   to end (up to a minute), then kills.
//! - A pause writes `pausing` before the checkpoint and `paused` after it; a paused
//!   sandbox keeps its directory (disk, checkpoint) and its slot (uid range, address), so
//!   a resume needs no rewriting. A failed pause leaves it running; a failed resume
//!   leaves it paused, and both say why.
//! - A snapshot is a checkpoint taken while the sandbox runs on, plus a copy-on-write
//!   copy of its directory taken at the same frozen instant (`snapshot.rs`). A sandbox
//!   made from one gets a copy of that copy, a new slot (uid range, address), id and
//!   token; envd is told the new token and environment with `/init`.
//! - A fork is a hidden snapshot and `count` sandboxes made from it.
//! - A rollback replaces a sandbox's processes and disk with one of its snapshots,
//!   keeping its id, slot, address and token.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cubicle_runtime::SandboxId;

use super::idle_conn::IDLE_CONN_TTL;
use super::inner::{Inner, blocking, now_ms, sandbox_env};
use super::teardown::spawn_watcher;
use crate::envd_client::{EnvdClient, InitRequest};
use crate::error::{Error, Result};
use crate::runtime::{CheckpointInfo, CheckpointSpec};
use crate::sandbox::{
    CreateRequest, DeathReason, InitPidfd, PauseMode, SandboxInfo, SandboxRecord, SandboxState,
};
use crate::snapshot::SnapshotRecord;
use crate::template::Template;
use crate::{fsutil, ids, procfs};

/// Directory of a sandbox's checkpoint inside its own directory (it counts against the
/// sandbox's disk quota: a paused sandbox's memory lives on its disk).
pub const CHECKPOINT_DIR: &str = "checkpoint";

/// Prefix of used-up checkpoint directories being removed (`checkpoint.old-<random>`);
/// reconciliation removes any a crash left.
pub const DISCARDED_CHECKPOINT_PREFIX: &str = "checkpoint.old-";

/// Removes a used-up checkpoint directory in the background, renaming it out of the way
/// first: the next pause or snapshot of the sandbox, which may start at once, writes its
/// checkpoint to the same place, and the removal must never touch that one.
pub(crate) fn discard_checkpoint(dir: std::path::PathBuf) {
    let trash = dir.with_file_name(format!(
        "{DISCARDED_CHECKPOINT_PREFIX}{}",
        ids::random_suffix(8)
    ));
    match std::fs::rename(&dir, &trash) {
        Ok(()) => {
            tokio::task::spawn_blocking(move || {
                let _ = fsutil::remove_tree(&trash);
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!("discarding {}: {e}; removing it in place", dir.display());
            let _ = fsutil::remove_tree(&dir);
        }
    }
}

/// What a long operation on one sandbox is doing (others get a conflict).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Busy {
    Pausing,
    Resuming,
    Snapshotting,
    RollingBack,
    /// Pushed to or pulled from the object store (`moving.rs`).
    Moving,
}

impl Busy {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Busy::Pausing => "being paused",
            Busy::Resuming => "being resumed",
            Busy::Snapshotting => "being snapshotted",
            Busy::RollingBack => "being rolled back",
            Busy::Moving => "being moved through the object store",
        }
    }
}

/// How to pause.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct PauseRequest {
    /// Keep memory and processes (`full`); false: disk only.
    pub memory: bool,
    /// Refuse (sandbox keeps running) when envd does not answer.
    pub require_healthy_guest: bool,
}

/// How a pause went.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PauseReport {
    /// How long the sandbox was stopped before its processes were gone (0 for a
    /// filesystem pause).
    pub frozen: Duration,
    /// The whole pause.
    pub total: Duration,
    /// Bytes of the checkpoint.
    pub bytes: u64,
    /// The checkpoint's steps.
    pub phases: Vec<(String, Duration)>,
}

/// What [`Node::resume`](super::Node::resume) found and did.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ResumeOutcome {
    /// The sandbox now.
    pub info: SandboxInfo,
    /// It was paused and is running again (else it was running: only its end time moved).
    pub resumed: bool,
    /// The resume's duration.
    pub took: Duration,
}

/// What to snapshot.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct SnapshotRequest {
    /// Names it answers to besides its id (e.g. `team/name:tag`).
    pub names: Vec<String>,
    /// Owner (opaque; the API's team).
    pub owner: String,
    /// Include memory and processes (default); false: disk only.
    pub memory: bool,
}

/// How a snapshot went.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SnapshotReport {
    /// The snapshot.
    pub snapshot: SnapshotRecord,
    /// How long the source was stopped.
    pub frozen: Duration,
    /// The whole operation.
    pub total: Duration,
}

fn conflict(id: &str, why: &str) -> Error {
    Error::Conflict(format!("sandbox '{id}' {why}"))
}

impl Inner {
    /// Marks `id` busy with `what` if its state is one of `allowed`; returns its record.
    pub(super) fn begin(
        &self,
        id: &str,
        what: Busy,
        allowed: &[SandboxState],
    ) -> Result<SandboxRecord> {
        let mut st = self.lock();
        let live = st
            .live_mut()
            .get_mut(id)
            .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
        if let Some(b) = live.busy {
            return Err(conflict(id, &format!("is {}", b.as_str())));
        }
        if !allowed.contains(&live.record.state) {
            return Err(match live.record.state {
                SandboxState::Paused => conflict(id, "is paused"),
                SandboxState::Running => conflict(id, "is running"),
                SandboxState::Dying | SandboxState::Dead => {
                    return Err(Error::SandboxNotFound(id.into()));
                }
                s => conflict(id, &format!("cannot be changed while {s:?}")),
            });
        }
        live.busy = Some(what);
        Ok(live.record.clone())
    }

    /// Before a checkpoint or stop of `id` (busy, so not routable): the data plane
    /// closes its connections to it.
    fn disconnect(&self, id: &str) {
        drop(self.take_envd_conn(id));
        if let Some(hook) = self.on_checkpoint.get() {
            hook(id);
        }
    }

    /// Ends a busy period; with `record`, stores it (memory and disk).
    pub(super) fn end(&self, id: &str, record: Option<&SandboxRecord>) -> Result<()> {
        // The busy mark goes whatever happens to the write (e.g. a full disk).
        let written = match record {
            Some(r) => fsutil::rewrite_json(&self.sandbox_dir(id).join("sandbox.json"), r)
                .map_err(Error::from),
            None => Ok(()),
        };
        let mut st = self.lock();
        if let Some(live) = st.live_mut().get_mut(id) {
            live.busy = None;
            if let Some(r) = record {
                live.record = r.clone();
                // Its init now (none while paused): what the watcher and the router use.
                live.init = r.pid.and_then(|p| InitPidfd::open(p, r.pid_start_time));
            }
        }
        drop(st);
        self.changed.notify_one();
        written
    }

    /// The template providing `record`'s root filesystem, on the very layers the record
    /// was made on (its upper layer and checkpoint only make sense over those).
    fn rootfs_template(&self, record: &SandboxRecord) -> Result<Template> {
        self.pinned_template(record.rootfs_template(), &record.layers)
    }

    /// Template `reference` (`name` or `name:tag`) with its layers pinned to `layers`,
    /// the layer ids a sandbox or snapshot was made on: a rebuild since then published
    /// other layers, but the old ones stay in the store while a record names them (GC
    /// keeps them, see [`Inner::layers_in_use`]). `layers` empty (a record of a template
    /// of the older layout): the template as it is.
    pub(crate) fn pinned_template(&self, reference: &str, layers: &[String]) -> Result<Template> {
        let (name, tag) = match reference.split_once(':') {
            Some((n, t)) => (n, Some(t)),
            None => (reference, None),
        };
        let template = self
            .templates
            .get_tagged(name, tag)?
            .ok_or_else(|| crate::template::Error::TemplateNotFound(reference.to_string()))?;
        if layers.is_empty() || template.config.layers == layers {
            return Ok(template);
        }
        let mut config = template.config.clone();
        config.layers = layers.to_vec();
        let pinned = self.templates.resolve(template.dir.clone(), config)?;
        for (id, path) in layers.iter().zip(pinned.lowers()) {
            if !path.is_dir() {
                return Err(crate::template::Error::LayerMissing(id.clone()).into());
            }
        }
        Ok(pinned)
    }

    fn checkpoint_support(&self) -> Result<()> {
        self.runtime.checkpoint_support().map_err(|why| {
            Error::Unsupported(format!(
                "this node cannot pause or snapshot sandboxes: {why}"
            ))
        })
    }

    // ---- pause ----

    pub(crate) async fn pause(
        self: &Arc<Self>,
        id: &str,
        req: PauseRequest,
    ) -> Result<PauseReport> {
        let t0 = Instant::now();
        if req.memory {
            self.checkpoint_support()?;
        }
        let mut record = self.begin(id, Busy::Pausing, &[SandboxState::Running])?;
        let running = record.clone();
        let res = self.pause_busy(&mut record, req, t0).await;
        match res {
            Ok(report) => {
                self.end(id, Some(&record))?;
                tracing::info!(sandbox = %id, mode = record.pause_mode.map(|m| m.as_str()).unwrap_or("?"),
                    frozen_us = report.frozen.as_micros() as u64, total_us = report.total.as_micros() as u64,
                    bytes = report.bytes, phases = ?report.phases, "sandbox paused");
                Ok(report)
            }
            Err(e) => {
                // Still running: as it was (the record on disk says so again).
                let _ = self.end(id, Some(&running));
                tracing::warn!(sandbox = %id, "pause failed, the sandbox runs on: {e}");
                Err(e)
            }
        }
    }

    async fn pause_busy(
        self: &Arc<Self>,
        record: &mut SandboxRecord,
        req: PauseRequest,
        t0: Instant,
    ) -> Result<PauseReport> {
        let id = record.id.clone();
        let pid = record
            .pid
            .filter(|p| procfs::is_alive(*p, record.pid_start_time))
            .ok_or_else(|| Error::SandboxNotFound(id.to_string()))?;
        // The data plane closes its connections to the sandbox (busy: none are routed to
        // it any more) first, so that envd drops them while the node asks its health and
        // writes the record; the dump waits for the last to go. (A pause refused below
        // costs the clients a reconnect.)
        self.disconnect(&id);
        let healthy = {
            let client = EnvdClient::new(self.envd_socket(&id), Some(record.access_token.clone()));
            matches!(
                tokio::time::timeout(Duration::from_millis(500), client.health()).await,
                Ok(Ok(true))
            )
        };
        if !healthy && (req.require_healthy_guest || !req.memory) {
            return Err(Error::Envd(format!(
                "envd of sandbox {id} does not answer; not pausing (the sandbox keeps running)"
            )));
        }
        let template = self.rootfs_template(record)?;
        let spec = self.checkpoint_spec(record, &template)?;
        let dir = self.sandbox_dir(&id).join(CHECKPOINT_DIR);
        if dir.exists() {
            fsutil::remove_tree(&dir)?;
        }
        // On disk first (a crash mid-pause is resolved from it); a full disk fails here,
        // before anything happened to the sandbox.
        let running = record.clone();
        let mut pausing = record.clone();
        pausing.state = SandboxState::Pausing;
        fsutil::rewrite_json(&self.sandbox_dir(&id).join("sandbox.json"), &pausing)?;
        *record = pausing;
        // The exit watcher would take the end of the processes for a death.
        self.stop_watcher(&id);
        // Where a pause's time goes (logged): the node's own steps (closing connections,
        // envd's health, the record) before the runtime's phases.
        let before_checkpoint = t0.elapsed();
        let rt = self.runtime.clone();
        let res = if req.memory {
            blocking(move || {
                rt.checkpoint(&CheckpointSpec {
                    start: &spec,
                    pid,
                    dir,
                    leave_running: false,
                    snapshot: None,
                    memory: true,
                })
            })
            .await
        } else {
            let slot = record.slot;
            blocking(move || rt.stop(&spec.id, slot).map(|()| CheckpointInfo::default())).await
        };
        let info = match res {
            Ok(i) => i,
            Err(e) => {
                *record = running;
                if procfs::is_alive(pid, record.pid_start_time) {
                    self.watch(&id);
                } else {
                    // Gone after all (e.g. killed mid-way): let the death path clean up.
                    let inner = self.clone();
                    let id2 = id.clone();
                    tokio::spawn(async move { inner.on_init_exit(id2).await });
                }
                return Err(e);
            }
        };
        // Sandboxes' overlays are `volatile` (runtime `rootfs.rs`): their end synced
        // nothing, and a paused sandbox (its disk, its checkpoint) is meant to outlast a
        // crash of the host. One commit, as the overlay's unmount used to make.
        let d = self.sandbox_dir(&id);
        if let Err(e) = blocking(move || {
            cubicle_syscalls::fs::sync_filesystem(&d)
                .map_err(|e| Error::Runtime(format!("sync {}: {e}", d.display())))
        })
        .await
        {
            tracing::warn!(sandbox = %id, "pause: {e}");
        }
        record.state = SandboxState::Paused;
        record.pause_mode = Some(if req.memory {
            PauseMode::Full
        } else {
            PauseMode::Filesystem
        });
        record.paused_at_ms = Some(now_ms());
        record.envd_unresponsive_at_pause = !healthy;
        record.pid = None;
        record.pid_start_time = None;
        let phases = std::iter::once(("checkpoint_called".to_string(), before_checkpoint))
            .chain(
                info.phases
                    .into_iter()
                    .map(|(name, d)| (name, d + before_checkpoint)),
            )
            .collect();
        Ok(PauseReport {
            frozen: info.frozen,
            total: t0.elapsed(),
            bytes: info.bytes,
            phases,
        })
    }

    fn stop_watcher(&self, id: &str) {
        let mut st = self.lock();
        if let Some(w) = st
            .live_unlisted()
            .get_mut(id)
            .and_then(|l| l.watcher.take())
        {
            w.abort();
        }
    }

    /// Watches the sandbox's current init (its pidfd in the live table) for its exit.
    fn watch(self: &Arc<Self>, id: &str) {
        let mut st = self.lock();
        if let Some(live) = st.live_mut().get_mut(id) {
            live.watcher = Some(spawn_watcher(
                Arc::downgrade(self),
                live.record.id.clone(),
                live.init.as_ref(),
            ));
        }
    }

    /// The sandbox `record` as it was started, for a checkpoint: its mounts decide what
    /// the dump marks external. Its volumes are among them: their content stays in the
    /// volume (not in the checkpoint), and a restore mounts the same volume directories
    /// again, idmapped as at create.
    fn checkpoint_spec(
        &self,
        record: &SandboxRecord,
        template: &Template,
    ) -> Result<crate::runtime::StartSpec> {
        let volumes = self.volume_binds(&record.volumes)?;
        Ok(self.start_spec(record, template, self.binds_of(record, template), volumes))
    }

    /// The extra bind mounts of a sandbox (what `prepare_sandbox_dir` adds besides the
    /// ctl directory): `/etc/hosts`, `/etc/resolv.conf`, the template's.
    pub(crate) fn binds_of(
        &self,
        record: &SandboxRecord,
        template: &Template,
    ) -> Vec<(std::path::PathBuf, std::path::PathBuf, bool)> {
        let dir = self.sandbox_dir(&record.id);
        let mut binds = vec![
            (dir.join("hosts"), "/etc/hosts".into(), false),
            (dir.join("resolv.conf"), "/etc/resolv.conf".into(), false),
        ];
        let ca = dir.join(super::create::CA_BUNDLE_FILE);
        if ca.exists() {
            binds.push((ca, super::create::CA_BUNDLE_TARGET.into(), false));
        }
        binds.extend(crate::template::code_interpreter::bind_for(
            &template.config,
        ));
        binds
    }

    // ---- resume ----

    pub(crate) async fn resume(
        self: &Arc<Self>,
        id: &str,
        timeout: Duration,
        memory: bool,
    ) -> Result<ResumeOutcome> {
        let t0 = Instant::now();
        {
            let st = self.lock();
            let live = st
                .live()
                .get(id)
                .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
            if live.record.state == SandboxState::Running && live.busy.is_none() {
                drop(st);
                // Running: only the end time moves (never earlier).
                let end = now_ms() + timeout.as_millis() as u64;
                let record = {
                    let mut st = self.lock();
                    let live = st
                        .live_mut()
                        .get_mut(id)
                        .ok_or_else(|| Error::SandboxNotFound(id.into()))?;
                    live.record.end_at_ms = live.record.end_at_ms.max(end);
                    live.record.clone()
                };
                fsutil::rewrite_json(&self.sandbox_dir(id).join("sandbox.json"), &record)?;
                self.changed.notify_one();
                return Ok(ResumeOutcome {
                    info: SandboxInfo::from_record(&record, self.envd_socket(id), 0),
                    resumed: false,
                    took: t0.elapsed(),
                });
            }
        }
        let mut record = self.begin(id, Busy::Resuming, &[SandboxState::Paused])?;
        let paused = record.clone();
        match self.resume_busy(&mut record, timeout, memory, t0).await {
            Ok(_) => {
                self.end(id, Some(&record))?;
                self.watch(id);
                let took = t0.elapsed();
                tracing::info!(sandbox = %id, took_us = took.as_micros() as u64,
                    steps = %record.runtime["timingsUs"], "sandbox resumed");
                // The checkpoint is used up; removing it frees its disk.
                discard_checkpoint(self.sandbox_dir(id).join(CHECKPOINT_DIR));
                Ok(ResumeOutcome {
                    info: SandboxInfo::from_record(
                        &record,
                        self.envd_socket(id),
                        took.as_micros() as u64,
                    ),
                    resumed: true,
                    took,
                })
            }
            Err(e) => {
                let _ = self.end(id, Some(&paused));
                tracing::warn!(sandbox = %id, "resume failed, the sandbox stays paused: {e}");
                Err(e)
            }
        }
    }

    async fn resume_busy(
        self: &Arc<Self>,
        record: &mut SandboxRecord,
        timeout: Duration,
        memory: bool,
        t0: Instant,
    ) -> Result<i32> {
        let id = record.id.clone();
        let template = self.rootfs_template(record)?;
        let full = record.pause_mode == Some(PauseMode::Full) && memory;
        let spec = self.prepare_sandbox_dir(record, &template)?;
        let rt = self.runtime.clone();
        let started = if full {
            let ck = self.sandbox_dir(&id).join(CHECKPOINT_DIR);
            blocking(move || rt.restore(&spec, &ck)).await?
        } else {
            blocking(move || rt.start(&spec)).await?
        };
        record.pid = Some(started.pid);
        record.pid_start_time = procfs::start_time(started.pid);
        record.runtime = started.state;
        let client = EnvdClient::new(self.envd_socket(&id), None);
        let (pid, pst) = (started.pid, record.pid_start_time);
        let ready = client
            .wait_ready(self.config.envd_ready_timeout, move || {
                procfs::is_alive(pid, pst)
            })
            .await;
        let mut conn = match ready {
            Ok(conn) => conn,
            Err(e) => {
                self.stop_after_failed_start(record).await;
                return Err(e);
            }
        };
        if !full {
            // A boot of the template over the kept disk: envd is new (born with the
            // sandbox's token, `birth_env`), tell it everything.
            let init = EnvdClient::new(self.envd_socket(&id), Some(record.access_token.clone()));
            conn = match init.init_on(conn, &InitRequest::for_record(record)).await {
                Ok(conn) => conn,
                Err(e) => {
                    self.stop_after_failed_start(record).await;
                    return Err(e);
                }
            };
            if let Some(cmd) = template
                .config
                .start_command
                .as_deref()
                .filter(|c| !c.trim().is_empty())
            {
                let authed =
                    EnvdClient::new(self.envd_socket(&id), Some(record.access_token.clone()));
                let spec = crate::envd_client::ProcessSpec {
                    cmd: "/bin/sh".into(),
                    args: vec!["-c".into(), cmd.to_string()],
                    ..Default::default()
                };
                if let Err(e) = authed.start_watched(&spec, 4096).await {
                    self.stop_after_failed_start(record).await;
                    return Err(e);
                }
            }
        }
        let _ = t0;
        // For the first request after the resume (`idle_conn.rs`).
        self.keep_envd_conn(&id, conn, Some(IDLE_CONN_TTL));
        record.state = SandboxState::Running;
        record.pause_mode = None;
        record.paused_at_ms = None;
        record.envd_unresponsive_at_pause = false;
        record.end_at_ms = now_ms() + timeout.as_millis() as u64;
        Ok(started.pid)
    }

    /// A resume or restore that started processes and then failed: stop them (the
    /// directory and slot stay).
    async fn stop_after_failed_start(self: &Arc<Self>, record: &SandboxRecord) {
        let rt = self.runtime.clone();
        let (id, slot) = (record.id.clone(), record.slot);
        let _ = blocking(move || rt.stop(&id, slot)).await;
    }

    // ---- snapshots ----

    pub(crate) async fn snapshot(
        self: &Arc<Self>,
        id: &str,
        req: SnapshotRequest,
        hidden: bool,
    ) -> Result<SnapshotReport> {
        let t0 = Instant::now();
        self.checkpoint_support()?;
        let record = self.begin(id, Busy::Snapshotting, &[SandboxState::Running])?;
        let res = self.snapshot_busy(&record, req, hidden, t0).await;
        self.end(id, None)?;
        match &res {
            Ok(r) => {
                tracing::info!(sandbox = %id, snapshot = %r.snapshot.id,
                    frozen_us = r.frozen.as_micros() as u64, total_us = r.total.as_micros() as u64, "snapshot taken");
                self.publish_snapshot(&r.snapshot);
            }
            Err(e) => tracing::warn!(sandbox = %id, "snapshot failed: {e}"),
        }
        res
    }

    async fn snapshot_busy(
        self: &Arc<Self>,
        record: &SandboxRecord,
        req: SnapshotRequest,
        hidden: bool,
        t0: Instant,
    ) -> Result<SnapshotReport> {
        let id = record.id.clone();
        let pid = record
            .pid
            .filter(|p| procfs::is_alive(*p, record.pid_start_time))
            .ok_or_else(|| Error::SandboxNotFound(id.to_string()))?;
        let template = self.rootfs_template(record)?;
        let spec = self.checkpoint_spec(record, &template)?;
        let snap_id = ids::new_sandbox_id();
        let storage_name = crate::snapshot::storage_name(&snap_id);
        let dir = self.sandbox_dir(&id).join(CHECKPOINT_DIR);
        if dir.exists() {
            fsutil::remove_tree(&dir)?;
        }
        if req.memory {
            self.disconnect(&id);
        }
        let rt = self.runtime.clone();
        let (dir2, name2, memory) = (dir.clone(), storage_name.clone(), req.memory);
        let info = blocking(move || {
            rt.checkpoint(&CheckpointSpec {
                start: &spec,
                pid,
                dir: dir2,
                leave_running: true,
                snapshot: Some(name2),
                memory,
            })
        })
        .await;
        // The running sandbox does not need its copy of the images.
        discard_checkpoint(dir.clone());
        let info = info?;
        let snap = SnapshotRecord {
            id: snap_id.to_string(),
            names: req.names,
            owner: req.owner,
            source: id.to_string(),
            template: record.template.clone(),
            base_template: record.rootfs_template().to_string(),
            layers: record.layers.clone(),
            memory: req.memory,
            hidden,
            created_at_ms: now_ms(),
            memory_mb: record.memory_mb,
            cpus: record.cpus,
            disk_mb: record.disk_mb,
            internet: record.internet,
            env_vars: record.env_vars.clone(),
            default_user: record.default_user.clone(),
            default_workdir: record.default_workdir.clone(),
            access_token: record.access_token.clone(),
            uid_base: record.uid_base,
            bytes: info.bytes,
            volumes: record.volumes.clone(),
        };
        if let Err(e) = self.snapshots.put(&snap) {
            let rt = self.runtime.clone();
            let _ = blocking(move || rt.remove_snapshot(&storage_name)).await;
            return Err(e);
        }
        Ok(SnapshotReport {
            snapshot: snap,
            frozen: info.frozen,
            total: t0.elapsed(),
        })
    }

    /// Deletes a snapshot (record and data).
    pub(crate) async fn delete_snapshot(&self, snap_id: &str) -> Result<()> {
        let snap = self
            .snapshots
            .get(snap_id)
            .ok_or_else(|| Error::SnapshotNotFound(snap_id.into()))?;
        self.snapshots.remove(&snap.id)?;
        let rt = self.runtime.clone();
        let name = snap.storage_name();
        blocking(move || rt.remove_snapshot(&name)).await
    }

    // ---- sandboxes from snapshots ----

    /// A new sandbox started from `snap`: `req` as for a create (its template names the
    /// snapshot; limits default to the snapshot's).
    pub(crate) async fn create_from_snapshot(
        self: &Arc<Self>,
        req: &CreateRequest,
        snap: &SnapshotRecord,
        id: SandboxId,
        timeout: Duration,
    ) -> Result<SandboxInfo> {
        let volumes = snapshot_volumes(req, snap)?;
        // Every volume must still exist (one deleted since the snapshot is the caller's
        // error, not a failed start).
        self.volume_binds(&volumes)?;
        let t0 = Instant::now();
        let template = self.pinned_template(&snap.base_template, &snap.layers)?;
        let _permit = self.pool.create_permits.clone().acquire_owned().await.ok();
        let mut env = snap.env_vars.clone();
        env.extend(req.env_vars.iter().map(|(k, v)| (k.clone(), v.clone())));
        env.extend(
            sandbox_env(&template, &Default::default(), &id)
                .into_iter()
                .filter(|(k, _)| k.starts_with("E2B_")),
        );
        env.insert("E2B_TEMPLATE_ID".into(), snap.id.clone());
        let kept = self.make_room().await;
        let record = self.reserve(&id, &template, kept, |r| {
            r.template = snap.id.clone();
            r.base_template = Some(snap.base_template.clone());
            r.end_at_ms = r.created_at_ms + timeout.as_millis() as u64;
            r.memory_mb = req.memory_mb.unwrap_or(snap.memory_mb);
            r.cpus = req.cpus.unwrap_or(snap.cpus);
            r.disk_mb = req.disk_mb.unwrap_or(snap.disk_mb);
            r.internet = req.internet;
            r.env_vars = env;
            r.metadata = req.metadata.clone();
            r.lifecycle = req.lifecycle;
            r.timeout_ms = timeout.as_millis() as u64;
            r.default_user = snap.default_user.clone();
            r.default_workdir = snap.default_workdir.clone();
            r.volumes = volumes;
        })?;
        match self
            .bring_up_from_snapshot(record, &template, snap, t0)
            .await
        {
            Ok(info) => Ok(info),
            Err(e) => {
                tracing::warn!(sandbox = %id, snapshot = %snap.id, "create from snapshot failed: {e}");
                self.clone().finish(&id, DeathReason::Exited, true).await;
                Err(e)
            }
        }
    }

    async fn bring_up_from_snapshot(
        self: &Arc<Self>,
        mut record: SandboxRecord,
        template: &Template,
        snap: &SnapshotRecord,
        t0: Instant,
    ) -> Result<SandboxInfo> {
        let id = record.id.clone();
        let dir = self.sandbox_dir(&id);
        if dir.exists() {
            let rt = self.runtime.clone();
            let (i2, d2) = (id.clone(), dir.clone());
            blocking(move || {
                rt.destroy(&i2, None, &d2)?;
                rt.remove_dir(&i2, &d2)
            })
            .await?;
        }
        let rt = self.runtime.clone();
        let (name, i2, d2, disk) = (snap.storage_name(), id.clone(), dir.clone(), record.disk_mb);
        blocking(move || rt.clone_snapshot(&name, &i2, &d2, disk)).await?;
        // The copy holds the source's log: this sandbox starts its own.
        let _ = std::fs::remove_file(dir.join("init.log"));
        let pid = self
            .start_from_copy(&mut record, template, snap, |r| {
                // Its pid on record before envd answers: a crash meanwhile leaves a
                // sandbox the next open can find and remove.
                fsutil::rewrite_json(&dir.join("sandbox.json"), r)?;
                self.update_record(r)
            })
            .await?;
        if !snap.memory
            && let Some(cmd) = template
                .config
                .start_command
                .as_deref()
                .filter(|c| !c.trim().is_empty())
        {
            let authed = EnvdClient::new(self.envd_socket(&id), Some(record.access_token.clone()));
            let spec = crate::envd_client::ProcessSpec {
                cmd: "/bin/sh".into(),
                args: vec!["-c".into(), cmd.to_string()],
                ..Default::default()
            };
            authed.start_watched(&spec, 4096).await?;
        }
        record.state = SandboxState::Running;
        fsutil::rewrite_json(&dir.join("sandbox.json"), &record)?;
        let ready_us = t0.elapsed().as_micros() as u64;
        {
            let mut st = self.lock();
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
            live.init = InitPidfd::open(pid, record.pid_start_time);
            live.watcher = Some(spawn_watcher(
                Arc::downgrade(self),
                id.clone(),
                live.init.as_ref(),
            ));
        }
        self.changed.notify_one();
        discard_checkpoint(dir.join(CHECKPOINT_DIR));
        tracing::info!(sandbox = %id, snapshot = %snap.id, ready_us, "sandbox started from a snapshot");
        Ok(SandboxInfo::from_record(
            &record,
            self.envd_socket(&id),
            ready_us,
        ))
    }

    // ---- fork ----

    pub(crate) async fn fork(
        self: &Arc<Self>,
        id: &str,
        count: usize,
        timeout: Duration,
    ) -> Result<Vec<Result<SandboxInfo>>> {
        let source = {
            let st = self.lock();
            st.live()
                .get(id)
                .map(|l| l.record.clone())
                .ok_or_else(|| Error::SandboxNotFound(id.into()))?
        };
        if source.state == SandboxState::Paused {
            return Err(conflict(
                id,
                "is paused and cannot be forked; resume it first",
            ));
        }
        let report = self
            .snapshot(
                id,
                SnapshotRequest {
                    memory: true,
                    ..Default::default()
                },
                true,
            )
            .await?;
        let snap = report.snapshot;
        let mut tasks = Vec::new();
        for _ in 0..count {
            let inner = self.clone();
            let snap = snap.clone();
            let req = CreateRequest {
                template: snap.id.clone(),
                internet: source.internet,
                metadata: source.metadata.clone(),
                lifecycle: source.lifecycle,
                ..Default::default()
            };
            tasks.push(tokio::spawn(async move {
                let id = ids::new_sandbox_id();
                inner.create_from_snapshot(&req, &snap, id, timeout).await
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(
                t.await
                    .map_err(|e| Error::Runtime(format!("fork task failed: {e}")))
                    .and_then(|r| r),
            );
        }
        if let Err(e) = self.delete_snapshot(&snap.id).await {
            tracing::warn!(snapshot = %snap.id, "removing a fork's snapshot: {e}");
        }
        Ok(out)
    }

    // ---- rollback ----

    pub(crate) async fn rollback(self: &Arc<Self>, id: &str, snap_name: &str) -> Result<Duration> {
        let t0 = Instant::now();
        self.checkpoint_support()?;
        let snap = self
            .snapshots
            .find(snap_name)
            .ok_or_else(|| Error::SnapshotNotFound(snap_name.into()))?;
        if snap.source != id {
            return Err(Error::InvalidRequest(format!(
                "snapshot '{snap_name}' was taken of sandbox '{}', not of '{id}'",
                snap.source
            )));
        }
        let mut record = self.begin(
            id,
            Busy::RollingBack,
            &[SandboxState::Running, SandboxState::Paused],
        )?;
        let before = record.clone();
        let res = self.rollback_busy(&mut record, &snap).await;
        match res {
            Ok(_) => {
                self.end(id, Some(&record))?;
                self.watch(id);
                let took = t0.elapsed();
                tracing::info!(sandbox = %id, snapshot = %snap.id, took_us = took.as_micros() as u64, "sandbox rolled back");
                Ok(took)
            }
            Err(e) => {
                // Its processes and disk are gone: it cannot be what it was. It stays
                // known with a death reason so that the caller learns why.
                let _ = self.end(id, None);
                tracing::warn!(sandbox = %id, "rollback failed: {e}");
                let _ = before;
                self.clone().finish(id, DeathReason::Exited, false).await;
                Err(e)
            }
        }
    }

    async fn rollback_busy(
        self: &Arc<Self>,
        record: &mut SandboxRecord,
        snap: &SnapshotRecord,
    ) -> Result<i32> {
        let id = record.id.clone();
        let dir = self.sandbox_dir(&id);
        let template = self.rootfs_template(record)?;
        self.stop_watcher(&id);
        self.disconnect(&id);
        let rt = self.runtime.clone();
        let (i2, d2, slot, running) = (
            id.clone(),
            dir.clone(),
            record.slot,
            record.state == SandboxState::Running,
        );
        let (name, disk) = (snap.storage_name(), record.disk_mb);
        let log = std::fs::read(dir.join("init.log")).unwrap_or_default();
        blocking(move || {
            if running {
                rt.stop(&i2, slot)?;
            }
            rt.remove_dir(&i2, &d2)?;
            rt.clone_snapshot(&name, &i2, &d2, disk)
        })
        .await?;
        let _ = std::fs::write(dir.join("init.log"), log);
        let pid = self
            .start_from_copy(record, &template, snap, |_| Ok(()))
            .await?;
        record.state = SandboxState::Running;
        record.pause_mode = None;
        record.paused_at_ms = None;
        if record.end_at_ms <= now_ms() {
            record.end_at_ms = now_ms() + record.timeout_ms.max(60_000);
        }
        discard_checkpoint(dir.join(CHECKPOINT_DIR));
        Ok(pid)
    }

    /// Starts `record`'s sandbox from the copy of `snap` already in its directory:
    /// restores its processes (a snapshot with memory) or boots it, calls `started`
    /// with the record holding the new init, waits for envd, and gives envd the
    /// record's token and environment (a restored envd still has the snapshot's; a
    /// booted one was born with the record's, `birth_env`). Returns the init's pid.
    async fn start_from_copy(
        &self,
        record: &mut SandboxRecord,
        template: &Template,
        snap: &SnapshotRecord,
        started: impl FnOnce(&SandboxRecord) -> Result<()>,
    ) -> Result<i32> {
        let id = record.id.clone();
        let spec = self.prepare_sandbox_dir(record, template)?;
        let rt = self.runtime.clone();
        let init = if snap.memory {
            let ck = self.sandbox_dir(&id).join(CHECKPOINT_DIR);
            blocking(move || rt.restore(&spec, &ck)).await?
        } else {
            blocking(move || rt.start(&spec)).await?
        };
        record.pid = Some(init.pid);
        record.pid_start_time = procfs::start_time(init.pid);
        record.runtime = init.state;
        started(record)?;
        let (pid, pst) = (init.pid, record.pid_start_time);
        let conn = EnvdClient::new(self.envd_socket(&id), None)
            .wait_ready(self.config.envd_ready_timeout, move || {
                procfs::is_alive(pid, pst)
            })
            .await?;
        let token = if snap.memory {
            snap.access_token.clone()
        } else {
            record.access_token.clone()
        };
        let conn = EnvdClient::new(self.envd_socket(&id), Some(token))
            .init_on(conn, &InitRequest::for_record(record))
            .await?;
        self.keep_envd_conn(&id, conn, Some(IDLE_CONN_TTL));
        Ok(init.pid)
    }
}

/// The volumes a sandbox made from `snap` mounts: the snapshot's (it remembers the
/// source's `volumeMounts`, as its environment and limits), unless the create names its
/// own. A snapshot with memory holds processes that had files of those volumes open at
/// those paths: it takes exactly the snapshot's mounts (or none named).
fn snapshot_volumes(
    req: &CreateRequest,
    snap: &SnapshotRecord,
) -> Result<Vec<crate::sandbox::VolumeMount>> {
    if req.volumes.is_empty() {
        return Ok(snap.volumes.clone());
    }
    crate::volume::check_mounts(&req.volumes)?;
    if snap.memory {
        let key = |v: &[crate::sandbox::VolumeMount]| {
            let mut v: Vec<_> = v
                .iter()
                .map(|m| (m.path.clone(), m.volume_id.clone(), m.read_only))
                .collect();
            v.sort();
            v
        };
        if key(&req.volumes) != key(&snap.volumes) {
            return Err(Error::InvalidRequest(format!(
                "snapshot '{}' holds running processes that use the volumes it was taken \
                 with ({}); a sandbox made from it mounts those same volumes at the same \
                 paths: leave volumeMounts out (or repeat them exactly)",
                snap.id,
                describe_mounts(&snap.volumes)
            )));
        }
    }
    Ok(req.volumes.clone())
}

fn describe_mounts(v: &[crate::sandbox::VolumeMount]) -> String {
    if v.is_empty() {
        return "none".into();
    }
    v.iter()
        .map(|m| format!("{} at {}", m.volume_id, m.path))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::VolumeMount;

    fn mount(id: &str, path: &str) -> VolumeMount {
        VolumeMount {
            volume_id: id.into(),
            path: path.into(),
            read_only: false,
        }
    }

    fn snap(memory: bool, volumes: Vec<VolumeMount>) -> SnapshotRecord {
        let mut s: SnapshotRecord = serde_json::from_value(serde_json::json!({
            "id": "s1", "source": "a", "template": "base", "baseTemplate": "base",
            "memory": memory, "createdAtMs": 1, "memoryMb": 512, "cpus": 1, "diskMb": 1024,
            "internet": true, "defaultUser": "user", "accessToken": "t", "uidBase": 65536,
        }))
        .unwrap();
        s.volumes = volumes;
        s
    }

    fn req(volumes: Vec<VolumeMount>) -> CreateRequest {
        CreateRequest {
            volumes,
            ..Default::default()
        }
    }

    /// A sandbox made from a snapshot mounts the snapshot's volumes unless the create
    /// names its own; with memory, only the very same mounts are accepted.
    #[test]
    fn a_snapshot_brings_its_volumes() {
        let v = vec![mount("vol-a", "/mnt/a"), mount("vol-b", "/mnt/b")];
        assert_eq!(
            snapshot_volumes(&req(vec![]), &snap(true, v.clone())).unwrap(),
            v
        );
        let mut same = v.clone();
        same.reverse();
        assert_eq!(
            snapshot_volumes(&req(same.clone()), &snap(true, v.clone())).unwrap(),
            same
        );
        for other in [
            vec![mount("vol-a", "/mnt/a")],
            vec![mount("vol-a", "/mnt/a"), mount("vol-b", "/mnt/elsewhere")],
            vec![mount("vol-a", "/mnt/a"), mount("vol-c", "/mnt/b")],
        ] {
            match snapshot_volumes(&req(other.clone()), &snap(true, v.clone())) {
                Err(Error::InvalidRequest(m)) => {
                    assert!(m.contains("vol-a at /mnt/a, vol-b at /mnt/b"), "{m}")
                }
                r => panic!("{other:?} accepted: {r:?}"),
            }
        }
        // No memory, no processes holding the volumes' files: any mounts.
        let other = vec![mount("vol-c", "/data")];
        assert_eq!(
            snapshot_volumes(&req(other.clone()), &snap(false, v.clone())).unwrap(),
            other
        );
        assert_eq!(
            snapshot_volumes(&req(vec![]), &snap(false, v.clone())).unwrap(),
            v
        );
        // A snapshot of a sandbox without volumes, created with some (without memory).
        assert_eq!(
            snapshot_volumes(&req(other.clone()), &snap(false, vec![])).unwrap(),
            other
        );
        assert!(
            snapshot_volumes(&req(vec![mount("x", "relative")]), &snap(false, vec![])).is_err()
        );
    }
}
