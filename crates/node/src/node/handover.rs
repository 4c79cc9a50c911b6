//! Handing a paused sandbox over to another node (issue 19, docs/cluster.md "Moving
//! sandboxes between nodes"), on top of the object store's push and pull (`moving.rs`):
//! who owns a paused sandbox once copies of it exist on two nodes.
//!
//! - Every node has an identity (`<state>/node-id`, a random id made on first use).
//! - `owners/<id>.json` in the bucket names the node that owns sandbox `id` once it was
//!   published: the publishing node writes itself there ([`Node::publish_paused`]), the
//!   node that takes it over writes itself there before it resumes it
//!   ([`Node::take_over`]). Owner records are never deleted: a later owner replaces them.
//! - A node that published a paused sandbox marks its directory (`.published`, not
//!   packed). Resuming such a sandbox first reads the owner record: when it names another
//!   node (or is gone), the sandbox moved away — the resume is refused and the local copy
//!   released, so a node that comes back after its sandboxes moved never resurrects one.
//!   [`Node::release_moved_away`] does the same for all of them at start. After a local
//!   resume the bucket's copy is stale: its manifest is deleted.
//! - In a cluster with a database (`cubicle node --database`), the database records
//!   which paused sandboxes have a published copy ([`PublishedCopies`]): when this node
//!   is lost they are left unowned rather than ended, and the next resume takes one to
//!   another node. This node asks the database before it resumes such a sandbox
//!   itself: once its lease ran out the sandbox may be another node's already.
//!
//! Without an object store none of this runs.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::Node;
use super::moving::MoveReport;
use super::stateful::ResumeOutcome;
use crate::error::{Error, IoContext, Result};
use crate::ids;
use crate::sandbox::SandboxState;

/// File of a node's identity in its state directory.
const IDENTITY_FILE: &str = "node-id";
/// Mark in a sandbox's directory: this node published it (not packed: dot files are not).
const PUBLISHED_MARK: &str = ".published";

fn owner_key(id: &str) -> String {
    format!("owners/{id}.json")
}

/// `owners/<id>.json`: which node owns a published sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OwnerRecord {
    /// The owning node's identity ([`Node::identity`]).
    pub node: String,
    /// When it became the owner (ms since the epoch).
    pub since_ms: u64,
}

/// The identity of the node on `state_dir` (made on first use).
pub fn identity_of(state_dir: &Path) -> Result<String> {
    let path = state_dir.join(IDENTITY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).ctx("read", &path),
    }
    let id = format!("node-{}", ids::random_suffix(16));
    let tmp = state_dir.join(format!(".{IDENTITY_FILE}.tmp"));
    std::fs::write(&tmp, id.as_bytes()).ctx("write", &tmp)?;
    std::fs::rename(&tmp, &path).ctx("rename", &path)?;
    Ok(id)
}

/// Whether the sandbox directory `dir` is marked published (see
/// [`Node::forget_published`]): the restart's reconcile then leaves alone a cgroup of its
/// name, which on a host shared by two nodes is the new owner's.
pub(crate) fn is_marked_published(dir: &Path) -> bool {
    dir.join(PUBLISHED_MARK).exists()
}

/// The cluster's record of which paused sandboxes have a published copy (`cubicle node
/// --database` keeps it in the `sandboxes` table: docs/cluster.md, "Paused sandboxes
/// outlive their node"). Both calls block; the node runs them on its blocking pool.
pub trait PublishedCopies: Send + Sync {
    /// Paused sandbox `id` was published: should this node be lost, it resumes on
    /// another node instead of ending.
    fn published(&self, id: &str) -> Result<()>;
    /// This node is about to resume its published sandbox `id` itself: the copy stops
    /// counting. An error refuses the resume ([`Error::Conflict`]: the sandbox is not
    /// this node's any more — its lease ran out, and another node may resume it).
    fn resuming(&self, id: &str) -> Result<()>;
}

/// What a takeover did.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TakeoverReport {
    /// The resume on this node.
    pub outcome: ResumeOutcome,
    /// Bytes downloaded.
    pub bytes: u64,
    /// Download time, ms.
    pub transfer_ms: f64,
    /// Pull (download and install), ms.
    pub pull_ms: f64,
    /// The whole takeover (owner record and resume included), ms.
    pub took_ms: f64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl Node {
    /// Records published paused sandboxes in `copies` from now on (once; later calls are
    /// ignored), and asks it before resuming one here.
    pub fn set_published_copies(&self, copies: std::sync::Arc<dyn PublishedCopies>) {
        let _ = self.inner.published_copies.set(copies);
    }

    /// [`PublishedCopies::published`], when the node has a record (a failure is logged:
    /// the copy still serves moves from a node that answers, not from a lost one).
    async fn record_published(&self, id: &str) {
        let Some(copies) = self.inner.published_copies.get().cloned() else {
            return;
        };
        let i2 = id.to_string();
        if let Err(e) = super::inner::blocking(move || copies.published(&i2)).await {
            tracing::warn!(sandbox = %id,
                "recording the published copy in the cluster's database failed (if this node is lost, the sandbox ends with it): {e}");
        }
    }

    /// Before resuming here a paused sandbox this node published: the cluster's record
    /// must still say it is this node's ([`PublishedCopies::resuming`]).
    pub(crate) async fn resuming_published(&self, id: &str) -> Result<()> {
        if !self.is_published(id) {
            return Ok(());
        }
        let Some(copies) = self.inner.published_copies.get().cloned() else {
            return Ok(());
        };
        let i2 = id.to_string();
        super::inner::blocking(move || copies.resuming(&i2)).await
    }

    /// The record of paused sandbox `id` as published in the object store, as its info
    /// (state paused): a replica shows it while no node owns it (its node was lost).
    pub async fn published_info(&self, id: &str) -> Result<crate::sandbox::SandboxInfo> {
        let (inner, id) = (self.inner.clone(), id.to_string());
        tokio::spawn(async move { inner.published_info(&id).await })
            .await
            .map_err(|e| Error::Runtime(format!("object store task failed: {e}")))?
    }

    /// Sandbox `id` as [`Node::get`] has it, or — while this node pulls it from the
    /// object store, before it is in the live table — as published, paused and busy. A
    /// replica names this node the sandbox's owner in the cluster's database before it
    /// asks for the takeover: another that reads it meanwhile must not hear "not found",
    /// which would record the sandbox as ended.
    pub async fn info(&self, id: &str) -> Result<crate::sandbox::SandboxInfo> {
        let arriving = self.inner.arrivals().contains(id);
        match self.get(id) {
            Err(Error::SandboxNotFound(_)) if arriving => match self.published_info(id).await {
                Ok(mut info) => {
                    info.busy = true;
                    Ok(info)
                }
                // Pulled meanwhile, or the pull failed: as the live table has it now.
                Err(_) => self.get(id),
            },
            r => r,
        }
    }

    /// This node's identity (`<state>/node-id`).
    pub fn identity(&self) -> Result<String> {
        identity_of(&self.inner.config.state_dir)
    }

    fn bucket(&self) -> Result<cubicle_objstore::Bucket> {
        self.object_store()
            .map(|c| c.bucket.clone())
            .ok_or_else(|| {
                Error::Unsupported(
                    "this node has no object store (start it with --object-store URL)".into(),
                )
            })
    }

    async fn set_owner(&self, id: &str) -> Result<()> {
        let rec = OwnerRecord {
            node: self.identity()?,
            since_ms: super::inner::now_ms(),
        };
        self.bucket()?.put_json(&owner_key(id), &rec).await?;
        Ok(())
    }

    async fn owner(&self, id: &str) -> Result<Option<OwnerRecord>> {
        Ok(self.bucket()?.get_json(&owner_key(id)).await?)
    }

    /// Whether this node published paused sandbox `id` (and has not resumed it since).
    pub fn is_published(&self, id: &str) -> bool {
        self.sandbox_dir(id).join(PUBLISHED_MARK).exists()
    }

    /// Publishes paused sandbox `id` so that another node can take it over: its owner
    /// record (this node), its directory and record ([`Node::push_paused`]).
    pub async fn publish_paused(&self, id: &str) -> Result<MoveReport> {
        self.set_owner(id).await?;
        let report = self.push_paused(id).await?;
        let mark = self.sandbox_dir(id).join(PUBLISHED_MARK);
        std::fs::write(&mark, b"").ctx("write", &mark)?;
        self.record_published(id).await;
        Ok(report)
    }

    /// After a pause: publish the sandbox when the object store says so (a failure is
    /// logged; the sandbox stays paused here and resumes here).
    pub(crate) async fn publish_after_pause(&self, id: &str) {
        if !self.object_store().is_some_and(|c| c.publish_paused) {
            return;
        }
        let t = Instant::now();
        match self.publish_paused(id).await {
            Ok(r) => tracing::info!(sandbox = %id, bytes = r.bytes_moved,
                took_ms = ms(t.elapsed()), "paused sandbox published"),
            Err(e) => tracing::warn!(sandbox = %id,
                "publishing the paused sandbox failed (it can resume only on this node): {e}"),
        }
    }

    /// Before a resume here: a sandbox this node published may have moved to another
    /// node since. Refused (and the local copy released) when the owner record names
    /// another node or is gone.
    pub(crate) async fn check_still_owner(&self, id: &str) -> Result<()> {
        let mark = self.sandbox_dir(id).join(PUBLISHED_MARK);
        if !mark.exists() || self.object_store().is_none() {
            return Ok(());
        }
        let me = self.identity()?;
        match self.owner(id).await? {
            Some(o) if o.node == me => Ok(()),
            other => {
                let whom = other.map_or("no node (its owner record is gone)".into(), |o| {
                    format!("node {}", o.node)
                });
                if let Err(e) = self.release_moved(id).await {
                    tracing::warn!(sandbox = %id, "releasing the moved sandbox: {e}");
                }
                Err(Error::Conflict(format!(
                    "sandbox {id} moved to another node: the object store names {whom} as its owner; this node released its copy"
                )))
            }
        }
    }

    /// Before a resume here of a sandbox this node published: the bucket's copy is about
    /// to be stale (its manifest is deleted, in the background; the owner record stays
    /// this node). The mark goes first, so a marked sandbox was never being resumed here
    /// since it was published: a restart need not look for half-resumed processes of it
    /// ([`is_marked_published`]).
    pub(crate) fn forget_published(&self, id: &str) {
        let mark = self.sandbox_dir(id).join(PUBLISHED_MARK);
        if std::fs::remove_file(&mark).is_err() {
            return;
        }
        let Ok(bucket) = self.bucket() else { return };
        let id = id.to_string();
        tokio::spawn(async move {
            if let Err(e) = bucket.delete(&format!("paused/{id}.json")).await {
                tracing::warn!(sandbox = %id, "deleting the stale paused copy: {e}");
            }
        });
    }

    /// Takes paused sandbox `id` over from the object store: pulls it, records this node
    /// as its owner (the node that published it refuses to resume it from then on), and
    /// resumes it with end time now + `timeout`. Already here and owned: just resumed.
    /// A failed resume leaves it paused here, owned by this node.
    pub async fn take_over(
        &self,
        id: &str,
        timeout: Duration,
        memory: bool,
    ) -> Result<TakeoverReport> {
        let t0 = Instant::now();
        let me = self.identity()?;
        let here = self.peek(id).ok().filter(|i| i.state != SandboxState::Dead);
        let (bytes, transfer, pull) = match here {
            Some(_) if self.owner(id).await?.is_some_and(|o| o.node == me) => {
                (0, Duration::ZERO, Duration::ZERO)
            }
            Some(_) => {
                return Err(Error::Conflict(format!(
                    "sandbox {id} is on this node already but not as its owner"
                )));
            }
            None => {
                let (_, r) = self.pull_paused(id).await?;
                (r.bytes_moved, r.transfer, r.took)
            }
        };
        if let Err(e) = self.set_owner(id).await {
            // Not ours: give the copy up again, the previous owner keeps it.
            let _ = self.release_moved(id).await;
            return Err(e);
        }
        let outcome = self.resume_here(id, timeout, memory).await?;
        let report = TakeoverReport {
            outcome,
            bytes,
            transfer_ms: ms(transfer),
            pull_ms: ms(pull),
            took_ms: ms(t0.elapsed()),
        };
        tracing::info!(sandbox = %id, bytes, pull_ms = report.pull_ms,
            resume_ms = ms(report.outcome.took), took_ms = report.took_ms,
            "sandbox taken over from the object store");
        Ok(report)
    }

    /// Releases every paused sandbox this node published that moved to another node
    /// since (at start, before the node serves: a node that comes back never lists
    /// them). Returns their ids.
    pub async fn release_moved_away(&self) -> Vec<String> {
        if self.object_store().is_none() {
            return Vec::new();
        }
        let mut released = Vec::new();
        for info in self.list() {
            let id = info.id.to_string();
            if info.state != SandboxState::Paused
                || !self.sandbox_dir(&id).join(PUBLISHED_MARK).exists()
            {
                continue;
            }
            match self.check_still_owner(&id).await {
                Ok(()) => {}
                Err(Error::Conflict(m)) => {
                    tracing::info!(sandbox = %id, "{m}");
                    released.push(id);
                }
                Err(e) => tracing::warn!(sandbox = %id, "checking its owner: {e}"),
            }
        }
        released
    }
}
