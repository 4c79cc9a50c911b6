//! A sandbox's death: record why (`dying` + reason), destroy its kernel objects, remove
//! its directory, free its slot, remember it among the recently dead. Also the exit
//! watcher that notices a sandbox whose init exited on its own.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::Duration;

use cubicle_runtime::SandboxId;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::inner::{DEAD_MEMORY, Inner, blocking};
use crate::fsutil;
use crate::sandbox::{DeathReason, InitPidfd, SandboxInfo, SandboxRecord, SandboxState};

impl Inner {
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
            let live = st.live_mut().get_mut(id)?;
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
        let _ = fsutil::rewrite_json(&dir.join("sandbox.json"), &record);
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
                st.live_mut().remove(id);
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
                if let Some(live) = st.live_mut().get_mut(id) {
                    live.teardown_failed = true;
                }
                true
            }
        }
    }

    /// Called when a sandbox's init exited on its own.
    pub(crate) async fn on_init_exit(self: Arc<Self>, id: SandboxId) {
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

/// Waits until the init behind `fd` has exited. The reactor watches the shared
/// descriptor itself (a node holding 10,000 sandboxes counts its descriptors); only if
/// it refuses (still registered by a watcher being aborted) a duplicate, and failing
/// that the pidfd is polled.
async fn wait_for_exit(id: &SandboxId, fd: Arc<OwnedFd>) {
    // SAFETY: the AsyncFd holds a reference to the descriptor, which stays open until it
    // deregisters it on drop; nobody closes it before (the Arc).
    let e = match unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) } {
        Ok(afd) => {
            let _ = afd.readable().await;
            return;
        }
        Err(e) => e,
    };
    let (fd, _) = e.into_parts();
    if let Ok(dup) = fd.try_clone() {
        // SAFETY: as above, for a descriptor of our own.
        match unsafe { AsyncFd::register_with_interest(dup, Interest::READABLE) } {
            Ok(afd) => {
                let _ = afd.readable().await;
                return;
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, "cannot watch the init's pidfd: {}; polling", e.into_parts().1)
            }
        }
    }
    while !cubicle_syscalls::pidfd::exited(&fd) {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Watch a sandbox's init through its pidfd (`None`: it is already gone); when it exits,
/// tear the sandbox down.
pub(crate) fn spawn_watcher(
    inner: Weak<Inner>,
    id: SandboxId,
    init: Option<&InitPidfd>,
) -> tokio::task::AbortHandle {
    let fd = init.map(|i| i.fd().clone());
    let task = tokio::spawn(async move {
        if let Some(fd) = fd {
            wait_for_exit(&id, fd).await;
        }
        if let Some(inner) = inner.upgrade() {
            // A new task: finish() aborts this watcher task.
            tokio::spawn(inner.on_init_exit(id));
        }
    });
    task.abort_handle()
}
