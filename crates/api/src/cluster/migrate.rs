//! The replica's side of moving sandboxes between nodes (docs/cluster.md, "Moving
//! sandboxes between nodes"): a resume (`connect`, the older resume route, the router's
//! auto-resume — all [`Backend::resume`]) of a sandbox paused on a node that is gone,
//! draining or full resumes it on another node instead.
//!
//! 1. Another node is chosen with the create's rules ([`RemoteBackend::place_except`]:
//!    answering, not draining, a free slot; warm pool, then free memory).
//! 2. The old node publishes the sandbox when it answers (`POST …/push`; nothing moves
//!    when it did at pause, as `cubicle node --object-store` does); when it is gone, the
//!    copy it published at pause is used.
//! 3. The new node takes it over (`POST …/takeover`: pull, owner record in the bucket,
//!    resume) — from then on the old node refuses to resume it (`handover.rs` in
//!    cubicle-node).
//! 4. The old node releases its copy (`POST …/release`), now or, when it cannot be
//!    reached, as soon as a poll sees it again ([`RemoteBackend::moved_away_from`]); a node
//!    that restarts releases such copies itself before it serves.
//! 5. The new owner is recorded in this replica's map (the cache every call routes by).
//!    With the cluster database (leases, `claim_sandbox`) it is recorded there too.
//!
//! Moves are serialized on the replica (one at a time; a second resume of the same
//! sandbox waits and finds it moved).
//!
//! With the cluster's database a paused sandbox whose node was **lost** (its lease ran
//! out) after publishing it is owned by no node ([`cubicle_store::Store::expire_lost_nodes`]):
//! [`RemoteBackend::resume_unowned`] picks a node as above, claims the sandbox for it in
//! the database (`claim_published`, under that node's epoch: of concurrent resumes on
//! any replicas exactly one wins), and has it take the sandbox over from the object
//! store. A failed takeover gives the claim back (`disown`). The lost node, should it
//! come back, finds the sandbox another node's and releases its copy.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use hyper::Method;

use cubicle_node::{ResumeOutcome, SandboxState, TakeoverReport};

use super::remote::{RemoteBackend, lock};
use crate::backend::Backend;

impl RemoteBackend {
    /// [`Backend::resume`] on a replica: on the sandbox's node, or on another one when
    /// that node is gone, draining or full.
    pub(super) async fn resume_or_move(
        &self,
        id: &str,
        timeout: Duration,
        memory: bool,
    ) -> cubicle_node::Result<ResumeOutcome> {
        let from = match self.owner(id) {
            Err(cubicle_node::Error::SandboxNotFound(_))
                if self
                    .inner
                    .cluster
                    .get()
                    .is_some_and(|db| db.is_unowned_published(id)) =>
            {
                return self.resume_unowned(id, timeout, memory).await;
            }
            r => r?,
        };
        let paused = self.get(id).is_ok_and(|i| i.state == SandboxState::Paused);
        if !paused {
            return self.resume_on(from, id, timeout, memory).await;
        }
        if self.is_down(from) {
            // Down at its last poll, which may be stale (a node that just restarted).
            self.poll(from).await;
        }
        if let Some(why) = self.why_move(from) {
            let moved = self.move_and_resume(id, from, timeout, memory, why).await;
            return match moved {
                // A draining node that answers still has it: better resumed there than
                // not at all (no other node could take it, e.g. no object store).
                Err(e) if !self.is_down(from) => {
                    tracing::warn!(sandbox = %id, node = %self.addr(from),
                        "moving failed ({e}); resuming it where it is");
                    self.resume_on(from, id, timeout, memory).await
                }
                other => other,
            };
        }
        match self.resume_on(from, id, timeout, memory).await {
            Err(cubicle_node::Error::Capacity(m)) => {
                let why = format!("node {} answered: {m}", self.addr(from));
                self.move_and_resume(id, from, timeout, memory, why).await
            }
            Err(e) => {
                // Gone since its last poll? Ask again.
                self.poll(from).await;
                match self.why_move(from) {
                    Some(why) => self.move_and_resume(id, from, timeout, memory, why).await,
                    None => Err(e),
                }
            }
            ok => ok,
        }
    }

    /// Resumes sandbox `id`, paused and published by a node that was lost since, on a
    /// live node (see the module doc).
    async fn resume_unowned(
        &self,
        id: &str,
        timeout: Duration,
        memory: bool,
    ) -> cubicle_node::Result<ResumeOutcome> {
        let _one_at_a_time = self.inner.move_lock.lock().await;
        let not_found = || cubicle_node::Error::SandboxNotFound(id.to_string());
        let db = self.inner.cluster.get().cloned().ok_or_else(not_found)?;
        if !db.is_unowned_published(id) {
            // Taken meanwhile (through this replica or another): resume it where it is.
            let owner = self.owner(id)?;
            return self.resume_on(owner, id, timeout, memory).await;
        }
        let t0 = Instant::now();
        let sid = id.to_string();
        let row = db
            .store
            .call(move |s| s.sandbox(&sid))
            .await
            .map_err(|e| cubicle_node::Error::Runtime(format!("the cluster's database: {e}")))?
            .ok_or_else(not_found)?;
        let (to, there) = self.place_except(&row.template_id, &[]).map_err(|e| {
            cubicle_node::Error::Capacity(format!(
                "sandbox {id} cannot resume: its node was lost, and no other node can take it ({e})"
            ))
        })?;
        let (name, epoch) = db.name_and_epoch(self, to).ok_or_else(|| {
            cubicle_node::Error::Capacity(format!(
                "node {} left the cluster; try again",
                self.addr(to)
            ))
        })?;
        let (sid, n) = (id.to_string(), name.clone());
        let claimed = db
            .store
            .call(move |s| s.claim_published(&sid, &n, epoch))
            .await
            .map_err(|e| cubicle_node::Error::Runtime(format!("the cluster's database: {e}")))?;
        if !claimed {
            let owner = self.owner(id)?;
            return self.resume_on(owner, id, timeout, memory).await;
        }
        tracing::info!(sandbox = %id, to = %self.addr(to), node = %name, epoch,
            "resuming the paused sandbox of a lost node from the object store; to {there}");
        let taken = self.takeover(to, id, timeout, memory).await;
        let taken = match taken {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(sandbox = %id, to = %self.addr(to),
                    "taking the sandbox over failed: {e}; it stays unowned for the next resume");
                let _ = self.release_copy(to, id).await;
                let (sid, n) = (id.to_string(), name.clone());
                let published_at = cubicle_store::now_ms();
                if let Err(e) = db
                    .store
                    .call(move |s| s.disown(&sid, &n, epoch, published_at))
                    .await
                {
                    tracing::error!(sandbox = %id, "giving the claim back failed: {e}");
                }
                return Err(e);
            }
        };
        self.remember(to, taken.outcome.info.clone());
        tracing::info!(sandbox = %id, to = %self.addr(to), node = %name,
            bytes = taken.bytes, pull_ms = taken.pull_ms, resume_ms = taken.outcome.took.as_secs_f64() * 1000.0,
            took_ms = t0.elapsed().as_secs_f64() * 1000.0, "sandbox of a lost node resumed on another node");
        Ok(taken.outcome)
    }

    fn addr(&self, node: usize) -> String {
        self.link(node).addr.clone()
    }

    fn is_down(&self, node: usize) -> bool {
        lock(&self.link(node).down).is_some()
    }

    /// Why a paused sandbox of node `node` must resume elsewhere, if it must.
    fn why_move(&self, node: usize) -> Option<String> {
        let link = self.link(node);
        if lock(&link.down).is_some() {
            // (Why is in the placement's reason: "skipped … down (…)".)
            return Some(format!("node {} is unreachable", link.addr));
        }
        if lock(&link.status).as_ref().is_some_and(|s| s.draining) {
            return Some(format!("node {} is draining", link.addr));
        }
        None
    }

    async fn move_and_resume(
        &self,
        id: &str,
        from: usize,
        timeout: Duration,
        memory: bool,
        why: String,
    ) -> cubicle_node::Result<ResumeOutcome> {
        let _one_at_a_time = self.inner.move_lock.lock().await;
        // Another resume may have moved it while this one waited.
        let owner = self.owner(id)?;
        if owner != from {
            return self.resume_on(owner, id, timeout, memory).await;
        }
        let t0 = Instant::now();
        let template = self.get(id)?.template;
        let (to, there) = self.place_except(&template, &[from]).map_err(|e| {
            cubicle_node::Error::Capacity(format!(
                "sandbox {id} cannot resume: {why}, and no other node can take it ({e})"
            ))
        })?;
        tracing::info!(sandbox = %id, from = %self.addr(from), to = %self.addr(to),
            "moving the paused sandbox: {why}; to {there}");
        if !self.is_down(from) {
            // Its node publishes it now unless it did at pause (then nothing moves).
            let pushed = self
                .call::<super::moving_api::WireMove>(
                    from,
                    Method::POST,
                    &format!("/sandboxes/{id}/push"),
                    None,
                    true,
                )
                .await;
            if let Err(e) = pushed {
                tracing::warn!(sandbox = %id, node = %self.addr(from),
                    "publishing from the old node failed (using the copy it published at pause): {e}");
            }
        }
        // With the cluster's database the move is claimed there first (compare and set
        // from the old node): one move wins, and the old node can no longer resume it.
        let claim = match self.inner.cluster.get().cloned() {
            Some(db) => match db.claim_move(self, id, from, to).await? {
                Some(claim) => Some((db, claim)),
                None => {
                    tracing::info!(sandbox = %id, "moved or ended meanwhile (the cluster's database); resuming it where it is");
                    lock(&self.inner.cache).remove(id);
                    let owner = self.owner(id)?;
                    return self.resume_on(owner, id, timeout, memory).await;
                }
            },
            None => None,
        };
        let taken = self.takeover(to, id, timeout, memory).await;
        let taken = match taken {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(sandbox = %id, to = %self.addr(to), "taking the sandbox over failed: {e}");
                if let Some((db, claim)) = claim {
                    let _ = self.release_copy(to, id).await;
                    db.give_back(id, claim).await;
                }
                return Err(e);
            }
        };
        // Remembered as moved before it is routed to `to`: a poll of `from` that starts
        // from here on must not route it back there.
        lock(&self.inner.moved).insert(
            id.to_string(),
            MovedAway {
                from,
                release: Release::InFlight,
            },
        );
        self.record_owner(id, to, taken.outcome.info.clone()).await;
        self.release_on(id, from).await;
        tracing::info!(sandbox = %id, from = %self.addr(from), to = %self.addr(to),
            bytes = taken.bytes, pull_ms = taken.pull_ms, resume_ms = taken.outcome.took.as_secs_f64() * 1000.0,
            took_ms = t0.elapsed().as_secs_f64() * 1000.0, "sandbox resumed on another node");
        Ok(taken.outcome)
    }

    /// Records `to` as the owner of sandbox `id`: this replica's map, and the cluster's
    /// database where it is shared (other replicas route by it, and nodes reconcile
    /// against it). A failure to record it there is logged: the sandbox runs on `to`
    /// either way, and this replica routes there.
    async fn record_owner(&self, id: &str, to: usize, info: cubicle_node::SandboxInfo) {
        self.remember(to, info);
        if let Some(db) = self.inner.cluster.get().cloned()
            && let Err(e) = db.transfer(self, id, to).await
        {
            tracing::error!(sandbox = %id, to = %self.addr(to),
                "recording the move in the cluster's database failed: {e}");
        }
    }

    /// Tells node `from` to release its copy of `id` (now, or when a poll sees it again:
    /// the move is remembered in `moved` until a poll of `from` no longer lists `id`).
    async fn release_on(&self, id: &str, from: usize) {
        let release = if self.is_down(from) {
            Release::Failed
        } else {
            match self.release_copy(from, id).await {
                Ok(()) => Release::DoneAt(Instant::now()),
                Err(e) => {
                    tracing::info!(sandbox = %id, node = %self.addr(from),
                        "the old node will release its copy later: {e}");
                    Release::Failed
                }
            }
        };
        if let Some(m) = lock(&self.inner.moved).get_mut(id) {
            m.release = release;
        }
    }

    /// `POST …/takeover` of sandbox `id` on node `to`: it pulls the published copy and
    /// resumes it (the move's last step, whether from a lost node or a live one).
    async fn takeover(
        &self,
        to: usize,
        id: &str,
        timeout: Duration,
        memory: bool,
    ) -> cubicle_node::Result<TakeoverReport> {
        let body = super::WireTimeout {
            timeout_ms: timeout.as_millis() as u64,
            memory,
            count: 0,
        };
        self.call::<TakeoverReport>(
            to,
            Method::POST,
            &format!("/sandboxes/{id}/takeover"),
            Self::json(&body),
            true,
        )
        .await
    }

    /// `POST …/release` of sandbox `id` on node `node` (one it no longer has is released).
    async fn release_copy(&self, node: usize, id: &str) -> cubicle_node::Result<()> {
        let path = format!("/sandboxes/{id}/release");
        match self
            .call::<()>(node, Method::POST, &path, None, false)
            .await
        {
            Ok(()) | Err(cubicle_node::Error::SandboxNotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// The sandboxes node `node` still lists although they moved away from it (kept out
    /// of the cache: they run elsewhere); each is released there in the background. Moves
    /// away from it of ids it no longer lists are forgotten.
    pub(super) fn moved_away_from(&self, node: usize, listed: &HashSet<String>) -> HashSet<String> {
        let mut away = HashSet::new();
        let mut to_release = Vec::new();
        lock(&self.inner.moved).retain(|id, m| {
            if m.from != node {
                return true;
            }
            if !listed.contains(id.as_str()) {
                return false;
            }
            away.insert(id.clone());
            if m.release.due() {
                to_release.push(id.clone());
            }
            true
        });
        for id in to_release {
            let rb = self.clone();
            tokio::spawn(async move {
                // The poll marks the node up only after this returns: call directly.
                match rb.release_copy(node, &id).await {
                    Ok(()) => {
                        tracing::info!(sandbox = %id, node = %rb.addr(node),
                            "the node that came back released its copy of the moved sandbox");
                    }
                    Err(e) => tracing::warn!(sandbox = %id, node = %rb.addr(node),
                        "releasing the moved sandbox's old copy: {e}"),
                }
            });
        }
        away
    }
}

/// A sandbox that moved away from node `from` while `from` may still list it: kept out of
/// the cache (it runs elsewhere) until a poll of `from` no longer lists it.
pub(super) struct MovedAway {
    pub(super) from: usize,
    pub(super) release: Release,
}

/// Where the old node's release of a moved sandbox stands.
pub(super) enum Release {
    /// The move itself is releasing it: a poll does not send a second release.
    InFlight,
    /// Released then: a poll that still lists it fetched its status before (or the node
    /// has not caught up); it is released again only after [`RELEASE_SETTLE`].
    DoneAt(Instant),
    /// Not released (the node was down or refused): every poll that lists it releases it.
    Failed,
}

/// How long after a successful release a node that still lists the sandbox is left
/// alone before it is told again.
const RELEASE_SETTLE: Duration = Duration::from_millis(500);

impl Release {
    /// Whether a poll that still lists the sandbox should release it now.
    fn due(&self) -> bool {
        match self {
            Release::InFlight => false,
            Release::DoneAt(at) => at.elapsed() >= RELEASE_SETTLE,
            Release::Failed => true,
        }
    }
}
