//! An API replica coordinated through the cluster's database (`cubicle serve --database
//! postgres://… --node-token-file FILE`, no `--node`; docs/cluster.md, "Leases,
//! placement and drain").
//!
//! - **Nodes** come from the `nodes` table (`cubicle node --database …` registers and
//!   renews there), re-read every [`PERIOD`]: a new node is linked (and
//!   polled as a `--node` one is), a lost one — or one that moved to another address —
//!   is retired: no longer polled or placed on, its sandboxes forgotten.
//! - **Placement.** A create reserves capacity with [`Store::place_sandbox`] (under a
//!   key of its own: a warm-pool claim names the sandbox itself), asks that node to
//!   create, and commits the reservation when the control plane records the sandbox
//!   ([`ClusterDb::commit`]: the row owned by the node under the epoch it was reserved
//!   under). A failed create releases the reservation; a commit refused because the
//!   node was fenced meanwhile makes the control plane kill the sandbox. Reservations
//!   queue on the node's row lock in the database, so replicas creating at once never
//!   oversubscribe a node.
//! - **Routing.** A sandbox this replica has not seen yet (created through another
//!   replica) is found through [`Store::sandbox_owner`] and fetched from its node.
//! - **Lost nodes.** Every replica runs [`Store::expire_lost_nodes`] each period; the
//!   database reports each lost node once, and the replica that got it emits the
//!   `killed` events (reason `node_lost`) of its sandboxes. Its paused sandboxes with a
//!   published copy are left unowned: this replica shows them as paused from their
//!   published record ([`ClusterDb::fetch`]) and a resume takes one to a live node
//!   (`migrate.rs`, `resume_unowned`).
//! - **Drain** ([`drain`]): the node is marked draining (no new placements) and its
//!   running sandboxes are paused ([`pause_for_drain`], a function of its own so that
//!   moving them to other nodes can take its place).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use hyper::Method;

use cubicle_node::{CreateRequest, PauseRequest, SandboxInfo};
use cubicle_store::{
    NODE_LOST_REASON, NodeRow, NodeState, Placement, Resources, SandboxRow, Store, now_ms,
};

use super::remote::{NodeLink, RemoteBackend, RemoteConfig, host_port, lock};
use crate::service::ControlPlane;

/// How long a reservation holds while its sandbox is created (a replica that died
/// mid-create frees it after this).
pub const PLACEMENT_TTL: Duration = Duration::from_secs(300);

/// What a create is assumed to need when it names no size (the template decides on the
/// node; the committed row records what it got).
const DEFAULT_NEED: Resources = Resources {
    cpu_count: 2,
    memory_mb: 512,
};

/// The replica's link to the cluster's database.
pub struct ClusterDb {
    pub(super) store: Store,
    /// Creates between their reservation and their commit, by the id the node gave.
    pending: Mutex<HashMap<String, Pending>>,
    /// The nodes as last read: name → (link index, row).
    nodes: Mutex<HashMap<String, (usize, NodeRow)>>,
}

/// A create between the node's answer and its commit: the reservation, and what the
/// create's log line (written at the commit) says.
struct Pending {
    placement: Placement,
    /// When the node answered.
    answered: Instant,
    /// How long the reservation and the node's create took.
    reserve: Duration,
    node: Duration,
    template: String,
    claimed: bool,
    why: String,
}

/// Milliseconds, for log fields.
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// How long a replica waits before it asks a sandbox's owner again when the owner
/// answered "not found" ([`ClusterDb::fetch_fresh`]).
const NOT_FOUND_RECHECK: Duration = Duration::from_millis(250);

/// How often a coordinated replica re-reads the node list and expires lost nodes.
pub const PERIOD: Duration = Duration::from_secs(1);

fn db_err(e: cubicle_store::Error) -> cubicle_node::Error {
    match e {
        cubicle_store::Error::NoCapacity(m) => cubicle_node::Error::Capacity(m),
        e => cubicle_node::Error::Runtime(format!("the cluster's database: {e}")),
    }
}

async fn blocking<T: Send + 'static>(
    store: &Store,
    f: impl FnOnce(&Store) -> cubicle_store::Result<T> + Send + 'static,
) -> cubicle_node::Result<T> {
    store.call(f).await.map_err(db_err)
}

impl RemoteBackend {
    /// A replica's backend over the nodes registered in `store` (none yet is fine:
    /// creates answer "no active node" until one registers).
    pub async fn connect_cluster(
        cfg: RemoteConfig,
        store: Store,
    ) -> Result<Self, cubicle_node::Error> {
        let rb = RemoteBackend::with_links(cfg, Vec::new())?;
        let db = Arc::new(ClusterDb {
            store,
            pending: Mutex::new(HashMap::new()),
            nodes: Mutex::new(HashMap::new()),
        });
        let _ = rb.inner().cluster.set(db.clone());
        db.refresh(&rb).await?;
        rb.poll_all().await;
        Ok(rb)
    }

    /// Whether this replica is coordinated through the cluster's database.
    pub fn is_coordinated(&self) -> bool {
        self.inner().cluster.get().is_some()
    }

    /// The nodes as this replica last read them from the database (empty without one).
    pub fn cluster_nodes(&self) -> Vec<NodeRow> {
        let Some(db) = self.inner().cluster.get() else {
            return Vec::new();
        };
        let mut v: Vec<NodeRow> = lock(&db.nodes).values().map(|(_, r)| r.clone()).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }
}

/// Re-reads the nodes and expires lost ones every [`PERIOD`] until the
/// task is aborted or the control plane is gone.
pub fn spawn(rb: RemoteBackend, cp: Weak<ControlPlane>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Some(db) = rb.inner().cluster.get().cloned() else {
            return;
        };
        let mut failing = false;
        loop {
            tokio::time::sleep(PERIOD).await;
            let Some(cp) = cp.upgrade() else { return };
            let r = async {
                db.expire(&rb, &cp).await?;
                db.refresh(&rb).await
            }
            .await;
            match r {
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!("the cluster's database answers again");
                }
                Ok(()) => {}
                Err(e) => {
                    if !failing {
                        tracing::warn!("cluster coordination: {e}");
                    }
                    failing = true;
                }
            }
        }
    })
}

impl ClusterDb {
    /// Re-reads the `nodes` table: links new nodes, retires lost or moved ones.
    async fn refresh(&self, rb: &RemoteBackend) -> cubicle_node::Result<()> {
        let rows = blocking(&self.store, |s| s.nodes(now_ms())).await?;
        let mut fresh = Vec::new();
        {
            let mut known = lock(&self.nodes);
            let names: std::collections::HashSet<&str> =
                rows.iter().map(|r| r.id.as_str()).collect();
            for (name, (i, _)) in known.iter() {
                if !names.contains(name.as_str()) {
                    retire(rb, *i);
                }
            }
            known.retain(|name, _| names.contains(name.as_str()));
            for row in &rows {
                let Ok(addr) = host_port(&row.address) else {
                    tracing::warn!(node = %row.id, address = %row.address, "node address is not http://HOST:PORT: skipped");
                    continue;
                };
                let i = match known.get(&row.id) {
                    Some((i, _)) if rb.link(*i).addr == addr => *i,
                    other => {
                        if let Some((old, _)) = other {
                            retire(rb, *old);
                        }
                        let i = rb.add_link(NodeLink::new(addr, Some(row.id.clone())));
                        fresh.push(i);
                        i
                    }
                };
                let link = rb.link(i);
                if row.state == NodeState::Lost {
                    if !link.retired() {
                        retire(rb, i);
                    }
                } else if link.retired() {
                    // Registered again under the same address.
                    link.retired.store(false, Ordering::Relaxed);
                    fresh.push(i);
                }
                known.insert(row.id.clone(), (i, row.clone()));
            }
        }
        for i in fresh {
            tracing::info!(node = ?rb.link(i).name, address = %rb.link(i).addr, "node joined the cluster");
            rb.poll(i).await;
        }
        Ok(())
    }

    /// Declares lost the nodes whose lease ran out; emits the events of their sandboxes.
    async fn expire(&self, rb: &RemoteBackend, cp: &ControlPlane) -> cubicle_node::Result<()> {
        let now = now_ms();
        let lost = blocking(&self.store, move |s| s.expire_lost_nodes(now)).await?;
        for n in lost {
            let (index, expired_at) = lock(&self.nodes)
                .get(&n.id)
                .map(|(i, r)| (Some(*i), r.lease_expires_at))
                .unwrap_or((None, now));
            tracing::warn!(
                node = %n.id,
                epoch = n.epoch,
                lease_expired_ms_ago = now - expired_at,
                sandboxes = n.sandboxes.len(),
                unowned = n.unowned.len(),
                "node lost: its lease ran out; its sandboxes are reported ended ({NODE_LOST_REASON}), \
                 except the paused ones with a published copy, which resume on another node at their next connect: {:?}",
                n.unowned
            );
            if let Some(i) = index {
                retire(rb, i);
            }
            cp.reported_ended(&n.sandboxes, NODE_LOST_REASON).await;
        }
        Ok(())
    }

    /// Whether a node in the cluster (not lost) reported template `name` present.
    pub(super) fn has_template(&self, name: &str) -> bool {
        lock(&self.nodes)
            .values()
            .any(|(_, n)| n.state != NodeState::Lost && n.templates.iter().any(|t| t == name))
    }

    /// The link of node `name` (read from the database if this replica does not know it
    /// yet); not found when it is lost or unknown.
    pub(super) fn link_of(&self, rb: &RemoteBackend, name: &str) -> Option<usize> {
        if let Some((i, _)) = lock(&self.nodes).get(name) {
            return (!rb.link(*i).retired()).then_some(*i);
        }
        let row = self.store.read(|s| s.node(name, now_ms())).ok()??;
        if row.state == NodeState::Lost {
            return None;
        }
        let addr = host_port(&row.address).ok()?;
        let i = rb.add_link(NodeLink::new(addr, Some(row.id.clone())));
        lock(&self.nodes).insert(row.id.clone(), (i, row));
        Some(i)
    }

    /// The link of the node that owns sandbox `id` (the database's word).
    pub(super) fn owner_link(&self, rb: &RemoteBackend, id: &str) -> cubicle_node::Result<usize> {
        let not_found = || cubicle_node::Error::SandboxNotFound(id.to_string());
        if !cubicle_node::SandboxId::is_valid(id) {
            return Err(not_found());
        }
        let owner = self
            .store
            .read(|s| s.sandbox_owner(id))
            .map_err(db_err)?
            .ok_or_else(not_found)?;
        self.link_of(rb, &owner.node_id).ok_or_else(not_found)
    }

    /// Whether sandbox `id` is paused with a published copy and owned by no node.
    pub(super) fn is_unowned_published(&self, id: &str) -> bool {
        cubicle_node::SandboxId::is_valid(id)
            && self
                .store
                .read(|s| s.is_unowned_published(id))
                .unwrap_or(false)
    }

    /// Unowned published sandbox `id` as its record in the object store says, asked of
    /// the nodes that answer until one does (not cached: no node holds it).
    async fn published_info(
        &self,
        rb: &RemoteBackend,
        id: &str,
    ) -> cubicle_node::Result<SandboxInfo> {
        let path = format!("/published/{id}");
        // No node answering says nothing of the sandbox (it must not be recorded dead);
        // a node that answers "not found" does: its published record is gone.
        let mut last = cubicle_node::Error::Runtime(format!(
            "sandbox {id} is paused in the object store, but no node answers to read it"
        ));
        let links = rb.links();
        for i in
            (0..links.len()).filter(|i| !links[*i].retired() && lock(&links[*i].down).is_none())
        {
            match rb
                .call::<SandboxInfo>(i, Method::GET, &path, None, false)
                .await
            {
                Ok(info) => return Ok(info),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Claims the move of sandbox `id` from link `from` to link `to` in the database
    /// ([`Store::move_sandbox`]); `None` when `from` no longer owns it.
    pub(super) async fn claim_move(
        &self,
        rb: &RemoteBackend,
        id: &str,
        from: usize,
        to: usize,
    ) -> cubicle_node::Result<Option<MoveClaim>> {
        let from_name = rb.link(from).name.clone().unwrap_or_default();
        let (name, epoch) = self.name_and_epoch(rb, to).ok_or_else(|| {
            cubicle_node::Error::Capacity(format!(
                "node {} left the cluster; try again",
                rb.link(to).addr
            ))
        })?;
        let (sid, n) = (id.to_string(), name.clone());
        let before = blocking(&self.store, move |s| {
            s.move_sandbox(&sid, &from_name, &n, epoch)
        })
        .await?;
        Ok(before.map(|before| MoveClaim {
            node: name,
            epoch,
            before,
        }))
    }

    /// Undoes a [`ClusterDb::claim_move`] whose takeover failed ([`Store::give_back`]).
    pub(super) async fn give_back(&self, id: &str, claim: MoveClaim) {
        let sid = id.to_string();
        let r = blocking(&self.store, move |s| {
            s.give_back(&sid, &claim.node, claim.epoch, &claim.before, now_ms())
        })
        .await;
        if let Err(e) = r {
            tracing::error!(sandbox = %id, "giving the claimed move back failed: {e}");
        }
    }

    /// The cluster name and current epoch of link `i`'s node, as last read.
    pub(super) fn name_and_epoch(&self, rb: &RemoteBackend, i: usize) -> Option<(String, i64)> {
        let name = rb.link(i).name.clone()?;
        let epoch = lock(&self.nodes).get(&name).map(|(_, r)| r.epoch)?;
        Some((name, epoch))
    }

    /// Records that sandbox `id` now runs on link `to` (it moved there from a node that
    /// was gone, draining or full), under that node's current epoch: other replicas route
    /// to it, and the old node's reconciliation no longer counts it as its own.
    pub(super) async fn transfer(
        &self,
        rb: &RemoteBackend,
        id: &str,
        to: usize,
    ) -> cubicle_node::Result<()> {
        let name = rb.link(to).name.clone().ok_or_else(|| {
            cubicle_node::Error::Runtime(format!(
                "node {} is not in the cluster's database",
                rb.link(to).addr
            ))
        })?;
        let epoch = lock(&self.nodes)
            .get(&name)
            .map(|(_, r)| r.epoch)
            .ok_or_else(|| cubicle_node::Error::Runtime(format!("node {name} left the cluster")))?;
        let (sid, n) = (id.to_string(), name.clone());
        let moved = blocking(&self.store, move |s| s.transfer_sandbox(&sid, &n, epoch)).await?;
        if !moved {
            tracing::warn!(sandbox = %id, node = %name, "the moved sandbox has ended in the cluster's database meanwhile");
        }
        Ok(())
    }

    /// Sandbox `id` from its owner's node (it was created through another replica), or,
    /// when no node owns it because its node was lost after publishing it paused, as its
    /// published record says (through any node that answers: they share the bucket).
    pub(super) fn fetch(&self, rb: &RemoteBackend, id: &str) -> cubicle_node::Result<SandboxInfo> {
        rb.block(self.fetch_fresh(rb, id))?
            .ok_or_else(|| cubicle_node::Error::SandboxNotFound(id.to_string()))
    }

    /// Sandbox `id` as its owner has it now, read from that node (another replica's
    /// pause, resume, move or kill shows here at once). `None` when the database has no
    /// owner for it: a create through this replica not committed yet, which only this
    /// replica's cache knows.
    pub(super) async fn fetch_fresh(
        &self,
        rb: &RemoteBackend,
        id: &str,
    ) -> cubicle_node::Result<Option<SandboxInfo>> {
        if !cubicle_node::SandboxId::is_valid(id) {
            return Err(cubicle_node::Error::SandboxNotFound(id.to_string()));
        }
        let mut asked = 0;
        loop {
            let (db, key) = (self.store.clone(), id.to_string());
            let owner = blocking(&db, move |s| s.sandbox_owner(&key)).await?;
            let i = match owner {
                Some(o) => match self.link_of(rb, &o.node_id) {
                    Some(i) => i,
                    None => return Ok(None),
                },
                None if self.is_unowned_published(id) => {
                    return self.published_info(rb, id).await.map(Some);
                }
                None => return Ok(None),
            };
            match rb
                .call::<SandboxInfo>(i, Method::GET, &format!("/sandboxes/{id}"), None, false)
                .await
            {
                Ok(info) => {
                    rb.remember(i, info.clone());
                    return Ok(Some(info));
                }
                // A node remembers the sandboxes that died on it, so "not found" for one
                // the database says it owns is rare — and, once, the instant between a
                // move's claim in the database and its takeover request reaching the
                // node (which from then on answers for it, `Node::info`). Asked again
                // after that instant before it counts: the caller records it ended.
                Err(cubicle_node::Error::SandboxNotFound(_)) if asked == 0 => {
                    asked += 1;
                    tokio::time::sleep(NOT_FOUND_RECHECK).await;
                }
                Err(e @ cubicle_node::Error::SandboxNotFound(_)) => {
                    rb.forget(id);
                    return Err(e);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A create: reserve on the node the database picks, create there, keep the
    /// reservation for [`ClusterDb::commit`] (released if the create fails).
    pub(super) async fn create(
        self: Arc<Self>,
        rb: &RemoteBackend,
        req: CreateRequest,
    ) -> cubicle_node::Result<SandboxInfo> {
        let t0 = Instant::now();
        let key = cubicle_node::ids::new_sandbox_id().to_string();
        let need = Resources {
            cpu_count: req.cpus.unwrap_or(DEFAULT_NEED.cpu_count),
            memory_mb: req.memory_mb.unwrap_or(DEFAULT_NEED.memory_mb),
        };
        let (k, template) = (key.clone(), req.template.clone());
        // A create that mounts volumes goes to their node (`super::volumes`), one of a
        // template's tag to its build node (`super::templates::tag_node`: tags are not
        // published); one from a snapshot to the snapshot's node when it can take it.
        let pinned = match super::volumes::pinned_node(rb, &req)? {
            Some(node) => Some(node),
            None => super::templates::tag_node(rb, &req.template),
        };
        let home = rb.snapshot_node(&req.template);
        let p = blocking(&self.store, move |s| match &pinned {
            Some(node) => {
                let ttl = PLACEMENT_TTL.as_millis() as i64;
                s.reserve_placement(node, &k, need, now_ms(), ttl)
            }
            None => place_near_snapshot(s, home.as_deref(), &k, &template, need),
        })
        .await?;
        let reserved = t0.elapsed();
        let Some(i) = self.link_of(rb, &p.node_id) else {
            self.release(&key).await;
            return Err(cubicle_node::Error::Capacity(format!(
                "node '{}' was placed on but is no longer in the cluster; try again",
                p.node_id
            )));
        };
        let why = self.why(&p.node_id, &req.template);
        let info: SandboxInfo = match rb
            .call(
                i,
                Method::POST,
                "/sandboxes",
                RemoteBackend::json_body(&req),
                true,
            )
            .await
        {
            Ok(info) => info,
            Err(e) => {
                self.release(&key).await;
                return Err(e);
            }
        };
        if let Some((_, row)) = lock(&self.nodes).get_mut(&p.node_id) {
            // Until the next read: the next create's log line counts this one.
            row.sandboxes += 1;
            row.cpu_used += u64::from(info.cpus);
            row.memory_mb_used += info.memory_mb;
        }
        lock(&self.pending).insert(
            info.id.to_string(),
            Pending {
                placement: p,
                answered: Instant::now(),
                reserve: reserved,
                node: t0.elapsed() - reserved,
                template: req.template.clone(),
                claimed: info.claimed,
                why,
            },
        );
        rb.remember(i, info.clone());
        Ok(info)
    }

    async fn release(&self, key: &str) {
        let k = key.to_string();
        if let Err(e) = blocking(&self.store, move |s| s.release_placement(&k)).await {
            tracing::warn!("releasing a placement: {e} (it expires by itself)");
        }
    }

    /// Why node `name` took a create of `template` (from the rows last read).
    fn why(&self, name: &str, template: &str) -> String {
        let nodes = lock(&self.nodes);
        let Some((_, n)) = nodes.get(name) else {
            return format!("node {name}");
        };
        let mut others: Vec<String> = nodes
            .values()
            .filter(|(_, o)| o.id != name)
            .map(|(_, o)| {
                format!(
                    "{} {} {}/{}",
                    o.id,
                    o.state.as_str(),
                    o.sandboxes,
                    o.capacity.max_sandboxes
                )
            })
            .collect();
        others.sort();
        format!(
            "node {name} ({}) through the cluster's database: template {template} {}, fewest sandboxes first ({} of {} sandboxes, {}/{} vCPUs, {}/{} MiB as this replica last saw it); others: {}",
            n.address,
            if n.templates.iter().any(|t| t == template) {
                "present"
            } else {
                "absent (fetched or built there)"
            },
            n.sandboxes,
            n.capacity.max_sandboxes,
            n.cpu_used,
            n.capacity.cpu_count,
            n.memory_mb_used,
            n.capacity.memory_mb,
            if others.is_empty() {
                "none".to_string()
            } else {
                others.join(", ")
            }
        )
    }

    /// Records a sandbox just made (blocking): a create commits its reservation (the row
    /// owned by the node under the reserved epoch); a fork's sandbox (made beside its
    /// parent, no reservation) is inserted and claimed by its node.
    pub(super) fn commit(
        &self,
        rb: &RemoteBackend,
        store: &Store,
        row: &SandboxRow,
    ) -> cubicle_store::Result<()> {
        let p = lock(&self.pending).remove(&row.id);
        match p {
            Some(p) => {
                let (waited, t0) = (p.answered.elapsed(), Instant::now());
                let r = store.commit_placement(&p.placement, row, now_ms());
                let commit = t0.elapsed();
                // The create's log line, with where its time went (`phases`: the
                // reservation, the node's create, the wait for the control plane's
                // record, the commit).
                tracing::info!(
                    sandbox = %row.id,
                    template = %p.template,
                    node = %p.placement.node_id,
                    epoch = p.placement.node_epoch,
                    claimed = p.claimed,
                    reserve_ms = ms(p.reserve),
                    ms = ms(p.reserve + p.node),
                    commit_ms = ms(commit),
                    phases = %format!(
                        "reserve {:.2} node {:.2} wait {:.2} commit {:.2}{}",
                        ms(p.reserve),
                        ms(p.node),
                        ms(waited),
                        ms(commit),
                        if r.is_ok() { "" } else { " (refused)" }
                    ),
                    "placed on {}",
                    p.why
                );
                r
            }
            None => {
                store.insert_sandbox(row)?;
                let node = lock(&rb.inner().cache)
                    .get(&row.id)
                    .and_then(|e| rb.link(e.node).name.clone());
                if let Some(name) = node {
                    let epoch = lock(&self.nodes).get(&name).map(|(_, r)| r.epoch);
                    if let Some(epoch) = epoch {
                        store.claim_sandbox(&row.id, &name, epoch)?;
                    }
                }
                Ok(())
            }
        }
    }
}

/// A move claimed in the database ([`ClusterDb::claim_move`]).
pub(super) struct MoveClaim {
    node: String,
    epoch: i64,
    before: cubicle_store::MovedFrom,
}

/// Retires link `i`: no more polls or placements; its sandboxes leave the cache.
fn retire(rb: &RemoteBackend, i: usize) {
    let link = rb.link(i);
    if !link.retired.swap(true, Ordering::Relaxed) {
        tracing::info!(node = ?link.name, address = %link.addr, "node left the cluster");
    }
    lock(&rb.inner().cache).retain(|_, e| e.node != i);
}

/// What a drain did.
#[derive(Debug, Default)]
pub struct DrainReport {
    /// Sandboxes paused (id, milliseconds the pause took).
    pub paused: Vec<(String, u128)>,
    /// Sandboxes that could not be paused, with why.
    pub failed: Vec<(String, String)>,
    /// Sandboxes that were already paused.
    pub already_paused: Vec<String>,
}

/// `cubicle node drain NAME`: marks node `name` draining (no new placements) and pauses
/// its running sandboxes (they stay its own, listed as paused). `tls`: how to reach a
/// node that serves TLS (its address in the database is `https://…`), as a replica does.
pub async fn drain(
    store: &Store,
    name: &str,
    token: &str,
    tls: Option<cubicle_router::NodeTls>,
) -> Result<DrainReport, String> {
    let row = mark_draining(store, name).await?;
    let mut cfg = RemoteConfig::new(vec![row.address.clone()], token.to_string());
    cfg.tls = tls;
    let rb = RemoteBackend::connect(cfg).await.map_err(|e| {
        format!("node '{name}' was marked draining, but its sandboxes were not paused: {e}")
    })?;
    let n = name.to_string();
    let owned = store
        .call(move |s| s.node_sandboxes(&n))
        .await
        .map_err(|e| e.to_string())?;
    Ok(pause_for_drain(&rb, &owned).await)
}

/// Marks node `name` draining in the cluster's database (no placement picks it) and
/// returns its row (where to reach it).
async fn mark_draining(store: &Store, name: &str) -> Result<NodeRow, String> {
    let n = name.to_string();
    store
        .call(move |s| {
            s.set_node_draining(&n, true)?;
            s.node(&n, now_ms())
        })
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("node '{name}' is not registered"))
}

/// `cubicle node drain NAME --migrate`: marks node `name` draining, then has the node
/// pause each sandbox with its memory and publish it to the object store, refusing
/// resumes from then on, so each resumes on another node at its next connect ("Moving
/// sandboxes between nodes" in docs/cluster.md; the node needs `--object-store`).
pub async fn drain_migrating(
    store: &Store,
    name: &str,
    token: &str,
    tls: Option<cubicle_router::NodeTls>,
) -> Result<super::moving_api::DrainReport, String> {
    let row = mark_draining(store, name).await?;
    super::moving_api::request_drain(&row.address, token, tls)
        .await
        .map_err(|e| {
            format!("node '{name}' was marked draining, but its sandboxes were not moved: {e}")
        })
}

/// The drain's treatment of a node's sandboxes: a full pause of each running one (memory
/// and processes kept; a later resume continues them). `rb` is connected to that node.
pub async fn pause_for_drain(rb: &RemoteBackend, ids: &[String]) -> DrainReport {
    use crate::backend::Backend;
    let mut report = DrainReport::default();
    for id in ids {
        match rb.get(id) {
            Ok(i) if i.state == cubicle_node::SandboxState::Paused => {
                report.already_paused.push(id.clone());
                continue;
            }
            Ok(i) if i.state == cubicle_node::SandboxState::Running => {}
            Ok(i) => {
                report
                    .failed
                    .push((id.clone(), format!("it is {:?}", i.state)));
                continue;
            }
            Err(e) => {
                report.failed.push((id.clone(), e.to_string()));
                continue;
            }
        }
        let t0 = Instant::now();
        let req = PauseRequest {
            memory: true,
            require_healthy_guest: false,
        };
        match rb.pause(id, req).await {
            Ok(_) => report.paused.push((id.clone(), t0.elapsed().as_millis())),
            Err(e) => report.failed.push((id.clone(), e.to_string())),
        }
    }
    report
}

/// Reserves room for a create of `template` under `key`: on node `home` when the
/// template is a snapshot that node holds (it is only there unless an object store makes
/// it movable), else — or when `home` has no room or is gone — where `place_sandbox` picks.
fn place_near_snapshot(
    s: &Store,
    home: Option<&str>,
    key: &str,
    template: &str,
    need: Resources,
) -> cubicle_store::Result<Placement> {
    let ttl = PLACEMENT_TTL.as_millis() as i64;
    if let Some(node) = home {
        match s.reserve_placement(node, key, need, now_ms(), ttl) {
            Err(e @ (cubicle_store::Error::NoCapacity(_) | cubicle_store::Error::NotFound(_))) => {
                tracing::info!(
                    node,
                    template,
                    "the snapshot's node cannot take it ({e}): placing elsewhere"
                );
            }
            r => return r,
        }
    }
    s.place_sandbox(key, template, need, now_ms(), ttl)
}
