//! Reconciliation at node start: whatever a previous run (or a crash) left is adopted if
//! it is alive and known, else removed.
//!
//! Adopted: a `<state>/sandboxes/<id>/sandbox.json` in state `running` (or `pausing`: the
//! pause did not finish) whose init pid is alive with the recorded start time and whose
//! envd answers `/health`. Kept: paused sandboxes (state `paused`, or `pausing` with a
//! complete checkpoint: the pause finished before the crash), with their slots; snapshots
//! that have both their record and their data. Removed: every other sandbox directory
//! (with whatever is mounted below it) and the kernel objects its record names (cgroup
//! `cubicle/<id>` and its processes, the veth and nftables entries of its slot), and
//! every network object of this node's slot range whose slot is not adopted or paused.
//!
//! Only what this state directory owns is touched: the node writes a sandbox's record
//! before it creates any kernel object, so its own leftovers are always found through
//! records, and its slot range is its own (`host_slots.rs`). Sandboxes of other nodes on
//! the host — another state directory, another slot range — are never reaped.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use cubicle_runtime::SandboxId;

use crate::envd_client::EnvdClient;
use crate::error::{IoContext, Result};
use crate::node::inner::{Inner, Live, blocking};
use crate::node::teardown::spawn_watcher;
use crate::sandbox::{InitPidfd, SandboxRecord, SandboxState};
use crate::{fsutil, procfs};

/// What reconciliation did.
#[derive(Debug, Default, Clone)]
pub struct ReconcileReport {
    /// Ids adopted as live sandboxes.
    pub adopted: Vec<String>,
    /// Ids whose leftovers were removed.
    pub removed: Vec<String>,
    /// Ids of paused sandboxes kept.
    pub paused: Vec<String>,
}

pub(crate) async fn reconcile(inner: &Arc<Inner>) -> Result<ReconcileReport> {
    let sdir = inner.config.state_dir.join("sandboxes");
    let mut report = ReconcileReport::default();
    // id -> slot (if known) of everything to remove
    let mut doomed: HashMap<String, Option<u32>> = HashMap::new();
    let mut candidates: Vec<SandboxRecord> = Vec::new();
    let mut paused: Vec<SandboxRecord> = Vec::new();
    let mut odd_entries = Vec::new();

    for e in std::fs::read_dir(&sdir).ctx("readdir", &sdir)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !SandboxId::is_valid(&name) {
            // Half-created quota directories and the recycle bin are the storage's to
            // adopt or remove (below), snapshots are checked against their records
            // (below), and the volumes' directory holds user data that outlives every
            // sandbox.
            if !cubicle_runtime::storage::is_working_entry(&name)
                && !name.starts_with(cubicle_runtime::storage::SNAPSHOT_PREFIX)
                && name != cubicle_runtime::storage::VOLUMES
            {
                odd_entries.push(e.path());
            }
            continue;
        }
        // Used-up checkpoints whose removal a crash cut short.
        for old in std::fs::read_dir(e.path()).into_iter().flatten().flatten() {
            if old
                .file_name()
                .to_string_lossy()
                .starts_with(crate::node::DISCARDED_CHECKPOINT_PREFIX)
            {
                let _ = fsutil::remove_tree(&old.path());
            }
        }
        match fsutil::read_json::<SandboxRecord>(&e.path().join("sandbox.json")) {
            Ok(r)
                if r.id == name
                    && matches!(r.state, SandboxState::Running | SandboxState::Pausing)
                    && r.pid.is_some_and(|p| procfs::is_alive(p, r.pid_start_time)) =>
            {
                // A crash mid-pause, mid-snapshot or mid-kill may have left it frozen
                // (its envd would then hang every request): thawing a thawed cgroup is a
                // no-op, so every adopted sandbox is thawed.
                if let Ok(cg) = cubicle_runtime::Cgroup::handle(&r.id) {
                    let _ = cg.thaw();
                }
                let mut r = r;
                r.state = SandboxState::Running;
                candidates.push(r)
            }
            Ok(mut r)
                if r.id == name
                    && (r.state == SandboxState::Paused
                        || (r.state == SandboxState::Pausing
                            && e.path()
                                .join(crate::node::CHECKPOINT_DIR)
                                .join(cubicle_checkpoint::META_FILE)
                                .is_file())) =>
            {
                // Paused (or paused completely before a crash): kept, with its slot.
                if r.state == SandboxState::Pausing {
                    r.state = SandboxState::Paused;
                    r.pause_mode = Some(crate::sandbox::PauseMode::Full);
                    r.paused_at_ms.get_or_insert(crate::node::inner::now_ms());
                    r.pid = None;
                    r.pid_start_time = None;
                    let _ = fsutil::rewrite_json(&e.path().join("sandbox.json"), &r);
                }
                paused.push(r);
            }
            Ok(r) => {
                doomed.insert(name, Some(r.slot));
            }
            Err(_) => {
                doomed.insert(name, None);
            }
        }
    }

    for r in candidates {
        let client = EnvdClient::new(inner.envd_socket(&r.id), Some(r.access_token.clone()));
        let healthy = matches!(
            tokio::time::timeout(Duration::from_secs(2), client.health()).await,
            Ok(Ok(true))
        );
        let adopted_pid = if healthy {
            let rt = inner.runtime.clone();
            let (id, dir) = (r.id.clone(), inner.sandbox_dir(&r.id));
            blocking(move || rt.adopt(&id, &dir)).await.ok()
        } else {
            None
        };
        let reserved =
            adopted_pid.is_some() && adopted_pid == r.pid && inner.lock().slots.reserve(r.slot);
        if !reserved {
            tracing::warn!(sandbox = %r.id, healthy, "not adoptable, removing");
            doomed.insert(r.id.to_string(), Some(r.slot));
            continue;
        }
        let pid = r.pid.unwrap_or(0);
        if r.internet || r.network.needs_network() {
            // The egress layer starts empty: give it the sandbox's policy again (the
            // kernel's share survived the restart; this re-applies it too).
            let rt = inner.runtime.clone();
            let (id, slot, policy) = (r.id.clone(), r.slot, r.network.clone());
            if let Err(e) = blocking(move || rt.set_network(&id, slot, pid, &policy)).await {
                tracing::warn!(sandbox = %r.id, "re-applying its network policy failed: {e}");
            }
        }
        let init = InitPidfd::open(pid, r.pid_start_time);
        let watcher = spawn_watcher(Arc::downgrade(inner), r.id.clone(), init.as_ref());
        tracing::info!(sandbox = %r.id, pid, "adopted");
        report.adopted.push(r.id.to_string());
        inner.lock().live_mut().insert(
            r.id.clone(),
            Live {
                watcher: Some(watcher),
                init,
                ..Live::new(r)
            },
        );
    }
    for r in paused {
        // A crash in the middle of a resume leaves restored processes, their cgroup and
        // veth behind while the record still says paused: stop them, the checkpoint is
        // still there and the next resume starts from it again.
        // (Not one published since it paused and not resumed since: on a host shared by
        // two nodes, a cgroup of its name is the node's that took it over.)
        let rt = inner.runtime.clone();
        let (id, slot) = (r.id.clone(), r.slot);
        let published =
            crate::node::handover::is_marked_published(&inner.sandbox_dir(r.id.as_str()));
        if !published && let Err(e) = blocking(move || rt.stop(&id, slot)).await {
            tracing::warn!(sandbox = %r.id, "clearing a half-resumed paused sandbox: {e}");
        }
        if !inner.lock().slots.reserve(r.slot) {
            tracing::warn!(sandbox = %r.id, slot = r.slot, "paused sandbox's slot is taken, removing it");
            doomed.insert(r.id.to_string(), Some(r.slot));
            continue;
        }
        tracing::info!(sandbox = %r.id, "kept paused");
        report.paused.push(r.id.to_string());
        inner.lock().live_mut().insert(r.id.clone(), Live::new(r));
    }
    for (id, slot) in doomed {
        let rt = inner.runtime.clone();
        let dir = inner.sandbox_dir(&id);
        let id2 = id.clone();
        let res = blocking(move || {
            rt.destroy(&id2, slot, &dir)?;
            rt.remove_dir(&id2, &dir)
        })
        .await;
        match res {
            Ok(()) => tracing::info!(sandbox = %id, "removed leftovers"),
            Err(e) => tracing::error!(sandbox = %id, "removing leftovers failed: {e}"),
        }
        report.removed.push(id);
    }
    for p in odd_entries {
        if let Err(e) = fsutil::remove_tree(&p) {
            tracing::warn!("removing stray {}: {e}", p.display());
        }
    }

    // Snapshots: a record without data or data without a record is a leftover, and so
    // is a fork's hidden snapshot (the fork it served was cut short).
    let rt = inner.runtime.clone();
    let stored = blocking(move || rt.snapshots()).await.unwrap_or_default();
    let mut kept = HashSet::new();
    for snap in inner.snapshots.list() {
        if snap.hidden || !stored.contains(&snap.storage_name()) {
            let _ = inner.snapshots.remove(&snap.id);
        } else {
            kept.insert(snap.storage_name());
        }
    }
    for name in stored {
        if !kept.contains(&name) {
            let rt = inner.runtime.clone();
            let n2 = name.clone();
            if let Err(e) = blocking(move || rt.remove_snapshot(&n2)).await {
                tracing::warn!("removing stray snapshot {name}: {e}");
            }
        }
    }

    // Quota ids and directories nobody uses any more (e.g. half-created ones).
    let rt = inner.runtime.clone();
    let mut known = report.adopted.clone();
    known.extend(report.paused.iter().cloned());
    if let Err(e) = blocking(move || rt.reconcile_storage(&known)).await {
        tracing::warn!("storage reconciliation failed: {e}");
    }
    let (owned, slots) = {
        let st = inner.lock();
        let slots: Vec<u32> = st.live().values().map(|l| l.record.slot).collect();
        (st.slots.range(), slots)
    };
    let rt = inner.runtime.clone();
    if let Err(e) = blocking(move || rt.reconcile_network(owned, &slots)).await {
        tracing::warn!("network reconciliation failed: {e}");
    }
    report.removed.sort();
    Ok(report)
}
