//! `cubicle node --database …`: the node's membership of the cluster (docs/cluster.md,
//! "Leases, placement and drain").
//!
//! - **Registration.** On start the node registers itself in the `nodes` table (name,
//!   the address replicas reach its node-side API at, capacity, templates present, warm
//!   pools) and is granted a lease under a new epoch.
//! - **Renewal.** Every [`RENEW_EVERY`] it renews the lease for [`LEASE`] (so a node
//!   that stops renewing is declared lost by the replicas within about ten seconds),
//!   reporting its templates and pools again. A thread of its own renews, with the
//!   report refreshed beside it, so that a busy node (a template store slow to read,
//!   tokio workers stuck in blocking calls) is not mistaken for a lost one.
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// What renewals report.
    report: Arc<KeptReport>,
}

/// Template names and warm pools, as the `nodes` row has them.
type Report = (Vec<String>, serde_json::Value);

/// What renewals report: the last value read, refreshed beside each renewal, so that a
/// slow read (a template store that takes seconds) delays the report, never a renewal.
struct KeptReport {
    value: Mutex<Report>,
    /// A refresh is under way.
    refreshing: AtomicBool,
    read: Box<dyn Fn() -> Report + Send + Sync>,
}

impl KeptReport {
    fn new(read: impl Fn() -> Report + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(KeptReport {
            value: Mutex::new(Default::default()),
            refreshing: AtomicBool::new(false),
            read: Box::new(read),
        })
    }

    /// The last value read; starts a refresh on `rt`'s blocking threads unless one is
    /// under way.
    fn get(self: &Arc<Self>, rt: &tokio::runtime::Handle) -> Report {
        if !self.refreshing.swap(true, Ordering::SeqCst) {
            let me = self.clone();
            rt.spawn_blocking(move || {
                me.set((me.read)());
                me.refreshing.store(false, Ordering::SeqCst);
            });
        }
        self.value.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, r: Report) {
        *self.value.lock().unwrap_or_else(|p| p.into_inner()) = r;
    }
}

/// How often a lease is renewed, and for how long.
#[derive(Clone, Copy)]
struct Cadence {
    every: Duration,
    lease: Duration,
}

/// The thread that keeps the lease ([`join`]); [`LeaseKeeper::stop`] ends it.
pub struct LeaseKeeper {
    stop: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl LeaseKeeper {
    /// Stops renewing: the lease then runs out by itself, and the cluster declares the
    /// node lost unless it comes back (and adopts its sandboxes) first. Waits for the
    /// thread (it wakes at once; a renewal under way finishes first), so that none is
    /// cut off by the process's exit, for `limit` at most.
    pub async fn stop(self, limit: Duration) {
        drop(self.stop);
        let thread = self.thread;
        let joined =
            tokio::time::timeout(limit, tokio::task::spawn_blocking(move || thread.join()));
        if joined.await.is_err() {
            tracing::warn!("the lease thread is still renewing after {limit:?}; not waiting");
        }
    }
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
) -> anyhow::Result<Option<LeaseKeeper>> {
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
        report: {
            let node = node.clone();
            KeptReport::new(move || report_of(&node))
        },
    });
    let lease = member.register().await?;
    let (stop, stopped) = std::sync::mpsc::channel();
    let rt = tokio::runtime::Handle::current();
    let thread = std::thread::Builder::new()
        .name("cubicle-lease".into())
        .spawn(move || member.keep(lease, &rt, &stopped))
        .context("starting the lease thread")?;
    Ok(Some(LeaseKeeper { stop, thread }))
}

fn host_name() -> anyhow::Result<String> {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .context("reading the host name (give --node-name)")?;
    let h = h.trim();
    anyhow::ensure!(!h.is_empty(), "the host has no name: give --node-name");
    Ok(h.to_string())
}

impl Member {
    /// Registers (a new epoch) and adopts what is still this node's.
    async fn register(self: &std::sync::Arc<Self>) -> anyhow::Result<NodeLease> {
        let node = self.node.clone();
        let (templates, pool_state) = tokio::task::spawn_blocking(move || report_of(&node))
            .await
            .context("report task")?;
        self.report.set((templates.clone(), pool_state.clone()));
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

    /// Renews the lease until `stopped` says so (see [`renew_until_stopped`]); registers
    /// again when fenced.
    fn keep(
        self: Arc<Self>,
        lease: NodeLease,
        rt: &tokio::runtime::Handle,
        stopped: &Receiver<()>,
    ) {
        let cadence = Cadence {
            every: RENEW_EVERY,
            lease: LEASE,
        };
        renew_until_stopped(
            &self.store,
            lease,
            cadence,
            &self.report,
            rt,
            stopped,
            |l| *self.lease.lock().unwrap_or_else(|p| p.into_inner()) = Some(l.clone()),
            || match rt.block_on(self.register()) {
                Ok(l) => Some(l),
                Err(e) => {
                    tracing::warn!(node = %self.reg.id, "registering again failed: {e:#}; retrying");
                    None
                }
            },
        );
    }
}

/// What node `node` has now: template names and its warm pools (reads the template
/// store: call it where blocking is allowed).
fn report_of(node: &Node) -> Report {
    let templates = node
        .templates()
        .list()
        .map(|v| v.into_iter().map(|t| t.config.name).collect())
        .unwrap_or_default();
    let pool = serde_json::to_value(node.pool_stats()).unwrap_or_default();
    (templates, pool)
}

/// Renews `lease` every `cadence.every` until `stopped` says so; `renewed` gets each
/// new lease, `fenced` registers again (a new lease, or `None` to retry at the next
/// turn). Meant for a thread of its own, renewing with the last report it has: then
/// nothing else the node does (a template store that takes seconds to read, tokio
/// workers stuck in a blocking call) delays a renewal. A node whose renewals stall is
/// declared lost and its sandboxes reported dead, which is far worse for its users than
/// a report a few seconds old.
#[allow(clippy::too_many_arguments)]
fn renew_until_stopped(
    store: &Store,
    mut lease: NodeLease,
    cadence: Cadence,
    report: &Arc<KeptReport>,
    rt: &tokio::runtime::Handle,
    stopped: &Receiver<()>,
    mut renewed: impl FnMut(&NodeLease),
    mut fenced: impl FnMut() -> Option<NodeLease>,
) {
    let node = lease.node_id.clone();
    let mut failing: Option<String> = None;
    let mut last = Instant::now();
    loop {
        match stopped.recv_timeout(cadence.every) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        let (templates, pool) = report.get(rt);
        let t0 = Instant::now();
        let r = store.renew_lease(
            &lease,
            now_ms(),
            cadence.lease.as_millis() as i64,
            &templates,
            &pool,
        );
        match r {
            Ok(l) => {
                renewed(&l);
                let since = last.elapsed();
                if since > 2 * cadence.every {
                    tracing::warn!(node = %node, epoch = l.epoch, "lease renewed {:.1} s after the one before (every {:?}; the database took {:.1} s)", since.as_secs_f64(), cadence.every, t0.elapsed().as_secs_f64());
                }
                last = Instant::now();
                if let Some(why) = failing.take() {
                    tracing::info!(node = %node, epoch = l.epoch, "lease renewed again (it failed: {why})");
                }
                lease = l;
            }
            Err(cubicle_store::Error::Fenced { epoch, .. }) => {
                tracing::warn!(
                    node = %node,
                    epoch,
                    "fenced: the cluster declared this node lost and reported its sandboxes dead; killing them and registering again (last renewal {:.1} s ago)",
                    last.elapsed().as_secs_f64()
                );
                if let Some(l) = fenced() {
                    failing = None;
                    last = Instant::now();
                    lease = l;
                }
            }
            Err(e) => {
                let left = lease.expires_at - now_ms();
                if failing.is_none() {
                    tracing::warn!(
                        node = %node,
                        "cannot renew the lease: {e}; it runs out in {:.1} s (then the cluster declares this node lost)",
                        left as f64 / 1000.0
                    );
                }
                failing = Some(e.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// The failure this guards against: a report that took seconds to read (a template
    /// store fitting a new template's files on a busy disk) held up the renewals, and
    /// the cluster declared a busy node lost, reporting its sandboxes dead.
    #[test]
    fn a_slow_report_does_not_delay_renewals() {
        let store = Store::open_in_memory().unwrap();
        let reg = NodeRegistration {
            id: "n1".into(),
            address: "http://127.0.0.1:9".into(),
            capacity: NodeCapacity {
                cpu_count: 1,
                memory_mb: 1,
                max_sandboxes: 1,
            },
            templates: Vec::new(),
            pool_state: serde_json::Value::Null,
        };
        let cadence = Cadence {
            every: Duration::from_millis(50),
            lease: Duration::from_millis(400),
        };
        let lease = store
            .register_node(&reg, now_ms(), cadence.lease.as_millis() as i64)
            .unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        // The first read is quick, every later one takes longer than the lease.
        let reads = Arc::new(AtomicUsize::new(0));
        let r2 = reads.clone();
        let report = KeptReport::new(move || {
            let n = r2.fetch_add(1, Ordering::SeqCst);
            if n > 0 {
                std::thread::sleep(Duration::from_millis(1500));
            }
            (vec![format!("read-{n}")], serde_json::Value::Null)
        });
        let renewals = Arc::new(AtomicUsize::new(0));
        let (stop, stopped) = std::sync::mpsc::channel();
        let keeper = {
            let (store, rt, renewals) = (store.clone(), rt.handle().clone(), renewals.clone());
            std::thread::spawn(move || {
                renew_until_stopped(
                    &store,
                    lease,
                    cadence,
                    &report,
                    &rt,
                    &stopped,
                    |_| {
                        renewals.fetch_add(1, Ordering::SeqCst);
                    },
                    || panic!("fenced: the node was declared lost"),
                )
            })
        };
        // A replica meanwhile: it declares lost every node whose lease ran out.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(1200) {
            let lost = store.expire_lost_nodes(now_ms()).unwrap();
            assert!(lost.is_empty(), "declared lost after {:?}", t0.elapsed());
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(stop);
        keeper.join().expect("the keeper ran without being fenced");
        let n = renewals.load(Ordering::SeqCst);
        assert!(n >= 10, "{n} renewals in 1.2 s at one per 50 ms");
        assert_eq!(reads.load(Ordering::SeqCst), 2, "one refresh at a time");
        // What the renewals reported: the quick first read (the slow one is still going).
        let row = store.node("n1", now_ms()).unwrap().unwrap();
        assert_eq!(row.templates, vec!["read-0".to_string()]);
        rt.shutdown_background();
    }
}
