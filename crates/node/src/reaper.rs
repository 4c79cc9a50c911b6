//! End-time enforcement by the node itself: one task sleeps until the earliest end time
//! (or until end times change), kills expired sandboxes with reason `timeout`, and retries
//! teardowns that failed. Every few seconds it also checks that the disk limits are still
//! enforced (see `SandboxRuntime::keep_quotas_enforced`). It holds only a weak reference,
//! so dropping the node stops it.

use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::node::inner::{Inner, now_ms};
use crate::sandbox::{DeathReason, SandboxState};

/// Longest sleep between checks (also the retry period of failed teardowns).
const MAX_SLEEP_MS: u64 = 1000;
/// Period of the check that the quota filesystem still enforces its limits.
const QUOTA_CHECK_MS: u64 = 5000;

pub(crate) async fn run(weak: Weak<Inner>) {
    let mut next_quota_check = 0;
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.closed.load(Ordering::SeqCst) {
            return;
        }
        let now = now_ms();
        if now >= next_quota_check {
            next_quota_check = now + QUOTA_CHECK_MS;
            check_quotas(&inner).await;
        }
        let mut next = now + MAX_SLEEP_MS;
        let mut expired = Vec::new();
        let mut retry = Vec::new();
        {
            let st = inner.lock();
            for (id, live) in st.live() {
                if live.teardown_failed {
                    retry.push((
                        id.clone(),
                        live.record.death_reason.unwrap_or(DeathReason::Exited),
                    ));
                } else if live.record.state == SandboxState::Running && live.busy.is_none() {
                    if live.record.end_at_ms <= now {
                        expired.push((id.clone(), live.record.lifecycle));
                    } else {
                        next = next.min(live.record.end_at_ms);
                    }
                }
            }
        }
        for (id, lifecycle) in expired {
            let inner = inner.clone();
            if lifecycle.auto_pause {
                tracing::info!(sandbox = %id, "end time reached, pausing");
                // Busy from now on, so the next pass leaves it alone.
                tokio::spawn(async move {
                    let req = crate::node::PauseRequest {
                        memory: lifecycle.auto_pause_memory,
                        require_healthy_guest: false,
                    };
                    if let Err(e) = inner.pause(&id, req).await {
                        if matches!(e, crate::Error::Conflict(_)) {
                            return;
                        }
                        tracing::warn!(sandbox = %id, "pausing at the end time failed, killing: {e}");
                        inner.finish(&id, DeathReason::Timeout, false).await;
                        return;
                    }
                    // Movable like one paused through the API (`handover.rs`).
                    crate::Node { inner }.publish_after_pause(&id).await;
                });
                continue;
            }
            tracing::info!(sandbox = %id, "end time reached, killing");
            tokio::spawn(async move { inner.finish(&id, DeathReason::Timeout, false).await });
        }
        for (id, reason) in retry {
            let inner = inner.clone();
            tokio::spawn(async move { inner.finish(&id, reason, false).await });
        }
        let notify = inner.changed.clone();
        drop(inner);
        let wait = Duration::from_millis(next.saturating_sub(now).max(1));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = notify.notified() => {}
        }
    }
}

/// Restarts the disk limits' enforcement if the quota filesystem lost it (a sysfs read
/// when all is well).
async fn check_quotas(inner: &std::sync::Arc<Inner>) {
    let rt = inner.runtime.clone();
    match crate::node::inner::blocking(move || rt.keep_quotas_enforced()).await {
        Ok(false) => {}
        Ok(true) => tracing::warn!(
            "the quota filesystem's accounting was marked inconsistent, so disk limits \
             were not enforced; a qgroup rescan was started to restore them"
        ),
        Err(e) => tracing::warn!("checking the quota filesystem's accounting: {e}"),
    }
}
