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
    /// Teardowns waiting for the refill ([`Pool::yield_to_refill`]), and their wake-up.
    yielding: std::sync::atomic::AtomicUsize,
    pub(crate) refilled: Notify,
    /// Background teardowns run at most this many at a time ([`TEARDOWNS_AT_ONCE`]).
    pub(crate) teardown_permits: Semaphore,
}

/// Background teardowns at a time: a burst of kills (or the backlog that waited for the
/// refill) otherwise ran all at once, on as many blocking threads, each taking kernel
/// locks (rtnl, cgroups) that the creates and claims of that moment need too. Not
/// fewer: a teardown mostly waits (its veth goes in a group delete shared with the
/// teardowns running with it), and two at a time took 1,000 teardowns 18 s longer.
const TEARDOWNS_AT_ONCE: usize = 16;

/// At most this many teardowns wait for the refill at a time; later ones start at once.
const MAX_YIELDING: usize = 256;

/// One claim under way, counted until dropped.
pub(crate) struct ClaimUnderWay<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for ClaimUnderWay<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[derive(Default)]
pub(super) struct PoolState {
    /// Ready sandbox ids per template, oldest first. Claims take the newest
    /// ([`PoolState::take`]): on the development machine (a PVM guest) a process pays
    /// again for memory it has not touched since its vCPU last went idle, and on any host
    /// the newest is the one most likely still in the CPU's caches; the oldest are what a
    /// full node removes to make room ([`PoolState::evict_oldest`], docs/bench.md round 34).
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

/// A pool's target grows up to this multiple of its configured size.
pub(super) const MAX_GROWTH: usize = 4;
/// How much each miss raises its pool's target. One is the deficit the miss shows; the
/// same load comes back faster once fewer of its creates wait, which leaves the refill
/// less time to make sandboxes while it lasts, so one more: a closed loop of 200 creates
/// against a pool of 64 missed 50–60 times; at the target one per miss raised, the same
/// loop again still missed 3 times in 2 of 3 runs (`docs/bench.md`, round 24).
pub(super) const GROWTH_PER_MISS: usize = 2;

impl PoolState {
    /// A create found `name`'s pool empty: counts the miss and raises the pool's target
    /// (up to [`MAX_GROWTH`] × `configured`; it shrinks back after a while without misses).
    pub(super) fn missed(&mut self, name: &str, configured: usize, now: Instant) {
        self.misses += 1;
        self.last_miss.insert(name.to_string(), now);
        let t = self.target.entry(name.to_string()).or_insert(configured);
        *t = (*t + GROWTH_PER_MISS).min(configured.max(1) * MAX_GROWTH);
    }

    /// Claims the newest ready sandbox of pool `name`, pooled or a shell: no longer a
    /// member, counted (as a claim, or as a miss that waited for a refill), and its
    /// time kept for the refill's pause after claims. `None`: the pool is empty.
    pub(super) fn take(&mut self, name: &str, after_miss: bool) -> Option<SandboxId> {
        let id = self.ready.get_mut(name)?.pop_back()?;
        self.remove_member(&id);
        if after_miss {
            self.waited += 1;
        } else {
            self.claims += 1;
        }
        let now = Instant::now();
        self.claim_gap = self.last_claim.map(|t| now.duration_since(t));
        self.last_claim = Some(now);
        Some(id)
    }

    /// Takes the oldest ready sandbox of the longest pool out of the pool (no claim:
    /// it is to be removed, its slot given to a create no pool serves).
    pub(super) fn evict_oldest(&mut self) -> Option<SandboxId> {
        let id = self
            .ready
            .values_mut()
            .max_by_key(|q| q.len())?
            .pop_front()?;
        self.remove_member(&id);
        Some(id)
    }

    pub(super) fn add_member(&mut self, id: SandboxId) -> bool {
        self.version += 1;
        self.members.insert(id)
    }

    /// Puts ready sandbox `id` of pool `name` back where the next claim takes it,
    /// unused (a claim that took it could not serve its create).
    pub(super) fn put_back(&mut self, name: &str, id: SandboxId) {
        self.add_member(id.clone());
        self.ready
            .entry(name.to_string())
            .or_default()
            .push_back(id);
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
    /// Killed sandboxes whose removal (cgroups, veth, directory) is still under way in
    /// the background, waiting for the refill or running.
    #[serde(default)]
    pub teardowns: u64,
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
            yielding: Default::default(),
            refilled: Notify::new(),
            teardown_permits: Semaphore::new(TEARDOWNS_AT_ONCE),
        }
    }

    /// Whether the refill is making sandboxes (members not ready yet) for a pool below
    /// its target.
    fn refilling(&self) -> bool {
        let ps = self.lock();
        let ready: usize = ps.ready.values().map(VecDeque::len).sum();
        ps.member_count() > ready
            && ps
                .target
                .iter()
                .any(|(n, t)| ps.ready.get(n).map_or(0, VecDeque::len) < *t)
    }

    /// Waits, for at most `limit`, while the refill makes sandboxes for a pool below its
    /// target (and `stop` is false): what a dead
    /// sandbox's teardown does first. Making a sandbox and removing one take the same
    /// CPU (namespaces, cgroups, veths, directories); a create that finds its pool
    /// empty waits for the former, nobody waits for the latter. So under a load that
    /// drains the pool (a closed loop of creates and kills), the removals come after
    /// the refill instead of taking half of its CPU. Bounded in time and in number
    /// ([`MAX_YIELDING`]): a dead sandbox still holds its slot, cgroups and network.
    pub(crate) async fn yield_to_refill(
        &self,
        limit: std::time::Duration,
        stop: &std::sync::atomic::AtomicBool,
    ) {
        use std::sync::atomic::Ordering::SeqCst;
        if limit.is_zero() || !self.refilling() {
            return;
        }
        if self.yielding.fetch_add(1, SeqCst) >= MAX_YIELDING {
            self.yielding.fetch_sub(1, SeqCst);
            return;
        }
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            // Registered before the check, so a wake-up between the two is not lost.
            let woken = self.refilled.notified();
            if stop.load(SeqCst) || !self.refilling() {
                break;
            }
            if tokio::time::timeout_at(deadline, woken).await.is_err() {
                break;
            }
        }
        self.yielding.fetch_sub(1, SeqCst);
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
            teardowns: self.teardowns.load(std::sync::atomic::Ordering::SeqCst) as u64,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::time::Duration;

    fn pool(target: usize) -> Pool {
        let mut cfg = crate::config::NodeConfig::new("/nonexistent", "/nonexistent");
        cfg.pool.insert("t".into(), target);
        Pool::new(&cfg)
    }

    #[test]
    fn a_miss_raises_the_target_up_to_four_times_the_configured_size() {
        let p = pool(4);
        let mut ps = p.lock();
        let t0 = Instant::now();
        ps.missed("t", 4, t0);
        assert_eq!((ps.target["t"], ps.misses), (4 + GROWTH_PER_MISS, 1));
        assert_eq!(ps.last_miss["t"], t0);
        for _ in 0..20 {
            ps.missed("t", 4, t0);
        }
        assert_eq!(ps.target["t"], 16);
        assert_eq!(ps.misses, 21);
    }

    /// A claim, pooled or a shell's, takes the newest ready sandbox, leaves the members,
    /// is counted and times the gap since the one before (what the refill's pause after
    /// claims reads); one put back is the next one taken; a full node evicts the oldest.
    #[test]
    fn a_claim_takes_the_newest_and_is_counted_and_timed() {
        let p = pool(4);
        let mut ps = p.lock();
        let ids: Vec<SandboxId> = (0..3).map(|_| crate::ids::new_sandbox_id()).collect();
        for id in &ids {
            ps.add_member(id.clone());
            ps.ready
                .entry("t".into())
                .or_default()
                .push_back(id.clone());
        }
        assert_eq!(ps.take("t", false).as_ref(), Some(&ids[2]));
        assert_eq!((ps.member_count(), ps.claims, ps.waited), (2, 1, 0));
        assert!(ps.last_claim.is_some() && ps.claim_gap.is_none());
        ps.put_back("t", ids[2].clone());
        assert_eq!(ps.take("t", true).as_ref(), Some(&ids[2]));
        assert_eq!((ps.member_count(), ps.claims, ps.waited), (2, 1, 1));
        assert!(ps.claim_gap.is_some_and(|g| g < Duration::from_secs(5)));
        assert_eq!(ps.evict_oldest().as_ref(), Some(&ids[0]));
        assert_eq!((ps.member_count(), ps.claims), (1, 1));
        assert_eq!(ps.take("t", false).as_ref(), Some(&ids[1]));
        assert_eq!(ps.take("t", false), None);
        assert_eq!(ps.take("other", false), None);
        assert_eq!(ps.evict_oldest(), None);
    }

    /// A teardown waits while the refill makes sandboxes for a pool below its target,
    /// and goes on when the pool is full (the refill's wake-up), at its limit, or when
    /// the node closes; it does not wait at all while the refill is idle.
    #[tokio::test]
    async fn a_teardown_yields_to_the_refill_until_the_pool_is_full() {
        let (p, open) = (Arc::new(pool(1)), Arc::new(AtomicBool::new(false)));
        let long = Duration::from_secs(30);
        // The refill idle: at once, though the pool is empty.
        tokio::time::timeout(Duration::from_secs(5), p.yield_to_refill(long, &open))
            .await
            .expect("waited with the refill idle");
        // One being made (a member, not ready).
        p.lock().add_member(crate::ids::new_sandbox_id());
        let waiting = {
            let (p, open) = (p.clone(), open.clone());
            tokio::spawn(async move { p.yield_to_refill(long, &open).await })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "did not wait for the refill");
        // A wake-up with the pool still below its target: it waits on.
        p.refilled.notify_waiters();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished(), "went on below the target");
        // Made: ready, and the pool full.
        let made = p.lock().member_ids().remove(0);
        p.lock()
            .ready
            .entry("t".into())
            .or_default()
            .push_back(made);
        p.refilled.notify_waiters();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("still waiting with the pool full")
            .unwrap();
        // Below the target again with one being made (a member, not ready): the limit
        // ends the wait, and so does a close.
        p.lock().ready.clear();
        let t0 = std::time::Instant::now();
        p.yield_to_refill(Duration::from_millis(300), &open).await;
        assert!(
            t0.elapsed() >= Duration::from_millis(290),
            "{:?}",
            t0.elapsed()
        );
        let waiting = {
            let (p, open) = (p.clone(), open.clone());
            tokio::spawn(async move { p.yield_to_refill(long, &open).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        open.store(true, SeqCst);
        p.refilled.notify_waiters();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("still waiting after the close")
            .unwrap();
        assert_eq!(p.yielding.load(SeqCst), 0);
    }
}
