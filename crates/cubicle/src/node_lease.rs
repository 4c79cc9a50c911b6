//! `cubicle node --database …`: the node's membership of the cluster (docs/cluster.md,
//! "Leases, placement and drain").
//!
//! - **Registration.** On start the node registers itself in the `nodes` table (name,
//!   the address replicas reach its node-side API at, capacity, templates present, warm
//!   pools) and is granted a lease under a new epoch.
//! - **Renewal.** Every [`RENEW_EVERY`] it renews the lease for [`LEASE`] (so a node
//!   that stops renewing is declared lost by the replicas within about ten seconds),
//!   reporting its templates and pools again.
//! - **Fencing.** When a renewal fails with [`cubicle_store::Error::Fenced`] the cluster
//!   declared this node lost (its lease ran out: a partition, a stall) and already
//!   reported its sandboxes dead. The node stops acting on them — it kills them — and
//!   registers again under a new epoch. A renewal that fails for another reason (the
//!   database unreachable) is retried; the node keeps its sandboxes until the database
//!   says it was fenced.
//! - **Adoption.** After each registration the node reconciles what it has with what
//!   the database says it owns: a sandbox whose row is running and is this node's (or
//!   nobody's) is claimed under the new epoch; one the cluster ended, or that another
//!   node owns, or that has no row, is killed; a row this node owns whose sandbox is gone
//!   is recorded as ended. Sandboxes created after the registration are left alone (a
//!   replica commits them). A paused sandbox this node published that is not its own
//!   any more (another node resumed it after this one was lost) is released, not
//!   killed: it lives on there.
//! - **Published paused sandboxes** ([`Ledger`], with `--object-store`): each sandbox
//!   the node publishes at pause is recorded as such (`Store::mark_published`), so that
//!   if this node is lost it is left unowned rather than ended and resumes on another
//!   node; before resuming one itself the node clears that mark under its current epoch
//!   (`Store::clear_published`) and refuses when the sandbox is no longer its own.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use cubicle_node::{DeathReason, Node, SandboxState};
use cubicle_store::{NodeCapacity, NodeLease, NodeRegistration, SandboxRowState, Store, now_ms};

/// How often the lease is renewed.
pub const RENEW_EVERY: Duration = Duration::from_secs(2);
/// How long a lease lasts past each renewal.
pub const LEASE: Duration = Duration::from_secs(8);

/// The cluster options of `cubicle node`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LeaseArgs {
    /// The cluster's database (`postgres://USER@HOST/DATABASE`): register this node there
    /// and keep its lease, so replicas (`cubicle serve --database …` without `--node`)
    /// find it and place sandboxes on it. Without it the node only serves the replicas
    /// that name it with `--node`.
    #[arg(long, env = "CUBICLE_DATABASE", value_name = "URL")]
    pub database: Option<String>,
    /// The address replicas reach this node's API at (default `http://<--listen>`; give
    /// it when --listen is a wildcard or behind NAT), e.g. `http://10.0.0.11:3100`.
    #[arg(long, env = "CUBICLE_NODE_ADVERTISE", value_name = "URL")]
    pub advertise: Option<String>,
    /// This node's name in the cluster (default: the host name). Keep it stable: a node
    /// that restarts under the same name adopts its sandboxes.
    #[arg(long, env = "CUBICLE_NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,
    /// vCPUs the sandboxes of this node may be given in total (default: 4 per host CPU).
    #[arg(long, value_name = "N")]
    pub capacity_cpus: Option<u32>,
    /// Memory (MiB) the sandboxes of this node may be given in total (default: twice
    /// the host's memory: limits, not use).
    #[arg(long, value_name = "MIB")]
    pub capacity_memory_mb: Option<u64>,
}

/// This node's standing in the cluster.
struct Member {
    store: Store,
    node: Node,
    reg: NodeRegistration,
    /// The lease held now (shared with the [`Ledger`]).
    lease: Arc<Mutex<Option<NodeLease>>>,
}

/// The node's [`cubicle_node::PublishedCopies`]: the `published_at` mark of its
/// sandboxes' rows, set and cleared under the lease it holds now.
struct Ledger {
    store: Store,
    lease: Arc<Mutex<Option<NodeLease>>>,
}

impl Ledger {
    fn lease(&self) -> cubicle_node::Result<NodeLease> {
        self.lease
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                cubicle_node::Error::Runtime("this node is not registered in the cluster".into())
            })
    }
}

fn not_ours(id: &str, why: &str) -> cubicle_node::Error {
    cubicle_node::Error::Conflict(format!(
        "sandbox {id} is no longer this node's in the cluster's database ({why}): another node resumes it"
    ))
}

impl cubicle_node::PublishedCopies for Ledger {
    fn published(&self, id: &str) -> cubicle_node::Result<()> {
        let l = self.lease()?;
        match self.store.mark_published(id, &l.node_id, l.epoch, now_ms()) {
            Ok(true) => Ok(()),
            Ok(false) => Err(not_ours(id, "not owned by this node")),
            Err(e) => Err(cubicle_node::Error::Runtime(format!(
                "the cluster's database: {e}"
            ))),
        }
    }

    fn resuming(&self, id: &str) -> cubicle_node::Result<()> {
        let l = self.lease()?;
        match self.store.clear_published(id, &l.node_id, l.epoch) {
            Ok(true) => Ok(()),
            Ok(false) => Err(not_ours(id, "this node's lease ran out meanwhile")),
            Err(cubicle_store::Error::Fenced { .. }) => {
                Err(not_ours(id, "this node was declared lost"))
            }
            Err(e) => Err(cubicle_node::Error::Runtime(format!(
                "cannot resume sandbox {id}: the cluster's database must confirm this node still owns it: {e}"
            ))),
        }
    }
}

/// Registers the node (when `--database` is given), adopts what is its own, and keeps
/// the lease in the background. `None` without `--database`.
pub async fn join(
    node: &Node,
    args: &LeaseArgs,
    listen: SocketAddr,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    let Some(url) = &args.database else {
        return Ok(None);
    };
    let store = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || Store::open_url(&url))
            .await
            .context("database task")?
            .context("opening the cluster's database (--database)")?
    };
    let name = match &args.node_name {
        Some(n) => n.clone(),
        None => host_name()?,
    };
    let address = match &args.advertise {
        Some(a) => a.trim_end_matches('/').to_string(),
        None if listen.ip().is_unspecified() => anyhow::bail!(
            "--listen {listen} is a wildcard address: give --advertise http://ADDR:PORT (where replicas reach this node)"
        ),
        None => format!("http://{listen}"),
    };
    let host = cubicle_node::host::stats(&node.config().state_dir);
    let capacity = NodeCapacity {
        cpu_count: args.capacity_cpus.unwrap_or(host.cpus.saturating_mul(4)),
        memory_mb: args
            .capacity_memory_mb
            .unwrap_or((host.memory_total >> 20).saturating_mul(2)),
        max_sandboxes: node.config().max_sandboxes,
    };
    let lease = Arc::new(Mutex::new(None));
    if node.object_store().is_some_and(|c| c.publish_paused) {
        node.set_published_copies(Arc::new(Ledger {
            store: store.clone(),
            lease: lease.clone(),
        }));
    }
    let member = std::sync::Arc::new(Member {
        store,
        lease,
        node: node.clone(),
        reg: NodeRegistration {
            id: name,
            address,
            capacity,
            templates: Vec::new(),
            pool_state: serde_json::Value::Null,
        },
    });
    let lease = member.register().await?;
    Ok(Some(tokio::spawn(member.keep(lease))))
}

fn host_name() -> anyhow::Result<String> {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .context("reading the host name (give --node-name)")?;
    let h = h.trim();
    anyhow::ensure!(!h.is_empty(), "the host has no name: give --node-name");
    Ok(h.to_string())
}

impl Member {
    /// What the node has now: template names and its warm pools.
    fn report(&self) -> (Vec<String>, serde_json::Value) {
        let templates = self
            .node
            .templates()
            .list()
            .map(|v| v.into_iter().map(|t| t.config.name).collect())
            .unwrap_or_default();
        let pool = serde_json::to_value(self.node.pool_stats()).unwrap_or_default();
        (templates, pool)
    }

    /// Registers (a new epoch) and adopts what is still this node's.
    async fn register(self: &std::sync::Arc<Self>) -> anyhow::Result<NodeLease> {
        let (templates, pool_state) = self.report();
        let reg = NodeRegistration {
            templates,
            pool_state,
            ..self.reg.clone()
        };
        let me = self.clone();
        let now = now_ms();
        let lease = tokio::task::spawn_blocking(move || {
            me.store.register_node(&reg, now, LEASE.as_millis() as i64)
        })
        .await
        .context("database task")?
        .with_context(|| {
            format!(
                "registering node '{}' in the cluster's database",
                self.reg.id
            )
        })?;
        tracing::info!(
            node = %self.reg.id,
            address = %self.reg.address,
            epoch = lease.epoch,
            cpus = self.reg.capacity.cpu_count,
            memory_mb = self.reg.capacity.memory_mb,
            max_sandboxes = self.reg.capacity.max_sandboxes,
            "registered in the cluster (lease {LEASE:?}, renewed every {RENEW_EVERY:?})"
        );
        *self.lease.lock().unwrap_or_else(|p| p.into_inner()) = Some(lease.clone());
        self.adopt(&lease, now).await;
        Ok(lease)
    }

    /// Reconciles this node's sandboxes with what the database says it owns (see the
    /// module doc). Sandboxes created at or after `registered_at` are left alone.
    async fn adopt(&self, lease: &NodeLease, registered_at: i64) {
        let local: Vec<String> = self
            .node
            .list()
            .into_iter()
            .filter(|i| i.state != SandboxState::Dead && (i.created_at_ms as i64) < registered_at)
            .map(|i| i.id.to_string())
            .collect();
        let (store, me, epoch) = (self.store.clone(), self.reg.id.clone(), lease.epoch);
        let local2 = local.clone();
        let verdict = tokio::task::spawn_blocking(move || {
            let mut keep = Vec::new();
            let mut drop = Vec::new();
            for id in &local2 {
                let row = store.sandbox(id)?;
                let mine = row
                    .as_ref()
                    .is_some_and(|r| r.state == SandboxRowState::Running)
                    && store.sandbox_owner(id)?.is_none_or(|o| o.node_id == me);
                if mine && store.claim_sandbox(id, &me, epoch)? {
                    keep.push(id.clone());
                } else {
                    drop.push(id.clone());
                }
            }
            // Rows this node owns whose sandbox is gone (it died while the node was down).
            let present: HashSet<&String> = local2.iter().collect();
            let mut gone = Vec::new();
            for id in store.node_sandboxes(&me)? {
                if !present.contains(&id) && store.mark_ended(&id, "lost", now_ms())? {
                    gone.push(id);
                }
            }
            Ok::<_, cubicle_store::Error>((keep, drop, gone))
        })
        .await;
        let (keep, drop, gone) = match verdict {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                tracing::warn!(node = %self.reg.id, "cannot reconcile with the cluster's database: {e}; keeping the sandboxes until the next registration");
                return;
            }
            Err(e) => {
                tracing::warn!("reconcile task: {e}");
                return;
            }
        };
        for id in &drop {
            // Published and paused: another node resumed it after this one was lost (on
            // a host two nodes share its cgroup is that node's now): only the copy goes.
            if self.node.is_published(id)
                && self
                    .node
                    .peek(id)
                    .is_ok_and(|i| i.state == SandboxState::Paused)
            {
                match self.node.release_moved(id).await {
                    Ok(()) => continue,
                    Err(e) => tracing::warn!(sandbox = %id, "releasing a moved sandbox: {e}"),
                }
            }
            // Ended by the cluster (this node was declared lost), another node's, or never
            // committed: this node must not serve it.
            if let Err(e) = self.node.kill_with_reason(id, DeathReason::Killed).await
                && !matches!(e, cubicle_node::Error::SandboxNotFound(_))
            {
                tracing::warn!(sandbox = %id, "killing a sandbox this node no longer owns: {e}");
            }
        }
        tracing::info!(
            node = %self.reg.id,
            epoch = lease.epoch,
            adopted = keep.len(),
            killed = drop.len(),
            ended = gone.len(),
            "reconciled with the cluster: adopted {keep:?}, killed (not this node's any more) {drop:?}, recorded as ended (gone) {gone:?}"
        );
    }

    /// Renews the lease until the task is aborted; registers again when fenced.
    async fn keep(self: std::sync::Arc<Self>, mut lease: NodeLease) {
        let mut failing: Option<String> = None;
        loop {
            tokio::time::sleep(RENEW_EVERY).await;
            let (templates, pool) = self.report();
            let (me, l) = (self.clone(), lease.clone());
            let r = tokio::task::spawn_blocking(move || {
                me.store
                    .renew_lease(&l, now_ms(), LEASE.as_millis() as i64, &templates, &pool)
            })
            .await;
            match r {
                Ok(Ok(l)) => {
                    *self.lease.lock().unwrap_or_else(|p| p.into_inner()) = Some(l.clone());
                    if let Some(why) = failing.take() {
                        tracing::info!(node = %self.reg.id, epoch = l.epoch, "lease renewed again (it failed: {why})");
                    }
                    lease = l;
                }
                Ok(Err(cubicle_store::Error::Fenced { epoch, .. })) => {
                    tracing::warn!(
                        node = %self.reg.id,
                        epoch,
                        "fenced: the cluster declared this node lost and reported its sandboxes dead; killing them and registering again"
                    );
                    match self.register().await {
                        Ok(l) => {
                            failing = None;
                            lease = l;
                        }
                        Err(e) => {
                            tracing::warn!(node = %self.reg.id, "registering again failed: {e:#}; retrying");
                        }
                    }
                }
                Ok(Err(e)) => {
                    let left = lease.expires_at - now_ms();
                    if failing.is_none() {
                        tracing::warn!(
                            node = %self.reg.id,
                            "cannot renew the lease: {e}; it runs out in {:.1} s (then the cluster declares this node lost)",
                            left as f64 / 1000.0
                        );
                    }
                    failing = Some(e.to_string());
                }
                Err(e) => tracing::warn!("lease task: {e}"),
            }
        }
    }
}
