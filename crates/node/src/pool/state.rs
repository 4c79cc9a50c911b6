//! The pools' bookkeeping: which sandboxes are pooled (ready per template, or being
//! made), the targets, the counters, and the node-wide create semaphore and background
//! thread handle. The node's shared state holds one [`Pool`]; the claim and refill logic
//! is `pool/mod.rs`.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cubicle_runtime::SandboxId;
use tokio::sync::{Notify, Semaphore};

/// The pools of one node.
pub(crate) struct Pool {
    inner: Mutex<PoolState>,
    /// Wakes the refill task (a claim, a miss, close).
    pub(crate) wake: Arc<Notify>,
    /// Wakes creates that found their pool empty: a refill made one ready.
    pub(crate) readied: Notify,
    /// Bounds concurrent cold creates and refills.
    pub(crate) create_permits: Arc<Semaphore>,
    /// Background teardowns in flight (`NodeConfig::async_teardown`).
    pub(crate) teardowns: std::sync::atomic::AtomicUsize,
    /// The low-priority background runtime (refills, async teardowns), once started.
    pub(crate) background: std::sync::OnceLock<tokio::runtime::Handle>,
    /// Claims under way (see [`Pool::claiming`]).
    claims_under_way: std::sync::atomic::AtomicUsize,
}

/// One claim under way, counted until dropped.
pub(crate) struct ClaimUnderWay<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for ClaimUnderWay<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[derive(Default)]
pub(super) struct PoolState {
    /// Ready sandbox ids per template, oldest first.
    pub(super) ready: BTreeMap<String, VecDeque<SandboxId>>,
    /// Every pooled id (ready or being made): hidden from listings, so changed only
    /// through [`PoolState::add_member`]/[`PoolState::remove_member`], which count the
    /// change in `version`.
    members: HashSet<SandboxId>,
    version: u64,
    /// Current target per template.
    pub(super) target: BTreeMap<String, usize>,
    pub(super) last_miss: BTreeMap<String, Instant>,
    /// When a create last claimed from a pool.
    pub(super) last_claim: Option<Instant>,
    /// Time between the last two claims (claims back to back: demand outruns a pause).
    pub(super) claim_gap: Option<std::time::Duration>,
    /// The last memory estimate per pooled sandbox, and when it was measured.
    pub(super) estimate: Option<(u64, Instant)>,
    /// Counters (for tests and the bench).
    pub(super) claims: u64,
    pub(super) misses: u64,
    pub(super) waited: u64,
    pub(super) refills: u64,
}

impl PoolState {
    pub(super) fn add_member(&mut self, id: SandboxId) -> bool {
        self.version += 1;
        self.members.insert(id)
    }

    pub(super) fn remove_member(&mut self, id: &str) -> bool {
        self.version += 1;
        self.members.remove(id)
    }

    pub(super) fn member_count(&self) -> usize {
        self.members.len()
    }

    pub(super) fn member_ids(&self) -> Vec<SandboxId> {
        self.members.iter().cloned().collect()
    }
}

/// Pool counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolStats {
    /// Ready sandboxes per template.
    pub ready: BTreeMap<String, usize>,
    /// Current target per template.
    pub target: BTreeMap<String, usize>,
    /// Creates served from a pool.
    pub claims: u64,
    /// Creates that could have used a pool but found it empty.
    pub misses: u64,
    /// Of the misses, those served by a refill that finished while they waited for a
    /// cold create's turn (the rest were made cold).
    #[serde(default)]
    pub waited: u64,
    /// Pooled sandboxes made.
    pub refills: u64,
}

impl Pool {
    pub(crate) fn new(config: &crate::config::NodeConfig) -> Pool {
        let st = PoolState {
            target: config.pool.clone(),
            ..Default::default()
        };
        Pool {
            inner: Mutex::new(st),
            wake: Arc::new(Notify::new()),
            readied: Notify::new(),
            create_permits: Arc::new(Semaphore::new(config.create_concurrency.max(1))),
            teardowns: Default::default(),
            background: Default::default(),
            claims_under_way: Default::default(),
        }
    }

    /// Counts a claim as under way until the value is dropped.
    pub(crate) fn claiming(&self) -> ClaimUnderWay<'_> {
        self.claims_under_way
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        ClaimUnderWay(&self.claims_under_way)
    }

    /// How many claims are under way.
    pub(super) fn claims_under_way(&self) -> usize {
        self.claims_under_way
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `id` is a pooled (unclaimed) sandbox.
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.lock().members.contains(id)
    }

    /// Drops `id` from the pool (its sandbox is gone).
    pub(crate) fn forget(&self, id: &str) {
        let mut ps = self.lock();
        if ps.remove_member(id) {
            for q in ps.ready.values_mut() {
                q.retain(|x| x != id);
            }
        }
    }

    /// Pool counters.
    pub(crate) fn stats(&self) -> PoolStats {
        let st = self.lock();
        PoolStats {
            ready: st.ready.iter().map(|(k, v)| (k.clone(), v.len())).collect(),
            target: st.target.clone(),
            claims: st.claims,
            misses: st.misses,
            waited: st.waited,
            refills: st.refills,
        }
    }

    /// Pooled ids (unclaimed), for hiding them from listings.
    pub(crate) fn members(&self) -> HashSet<SandboxId> {
        self.lock().members.clone()
    }

    /// Changes to the membership so far ([`crate::Node::listing_version`]).
    pub(crate) fn version(&self) -> u64 {
        self.lock().version
    }
}
