//! Warm pools: per template, sandboxes created ahead of demand and kept ready
//! (namespaces, overlay rootfs, cgroup, network, envd up and answering `/health`), envd
//! born with what a create that asks for no variables gives it (the template's
//! variables and the `E2B_*` ids, its access token, default user and workdir). A claim
//! is therefore the sandbox's record and a few small file writes, plus envd's `POST /init`
//! only when the create asks for more (`init_needed`), over the connection the refill's
//! ready check left open, which then carries the sandbox's first request
//! (`node/idle_conn.rs`). A claim takes the newest ready sandbox (`PoolState::take`).
//!
//! Ids: a pooled sandbox is created with a fresh random id (same generator as a cold
//! create), and that id is handed out by the claim: its directory, cgroup and hostname
//! already carry it, and random ids are indistinguishable to users.
//!
//! Who may claim: a create without a caller-chosen id whose disk quota is the template's,
//! with internet on (how pools are made, the SDKs' default) or off by a policy that
//! refuses every destination (E2B's `allow_internet_access: false`; `denies_everything`
//! says why not with one): the claim sets that policy on the pooled sandbox's interface
//! before anyone can use it, as `update_network` does to a running sandbox, so such a
//! sandbox keeps an `eth0` that reaches nothing, where a cold one has loopback only.
//! Other memory or CPU limits are written to the claimed sandbox's cgroup. Anything else
//! is created cold.
//!
//! Templates with a start command are pooled with it running and ready (its readiness
//! port answered): a refill first initialises envd with the sandbox's own variables
//! (`E2B_SANDBOX_ID`, …; the token stays its birth token), then starts the command as a
//! cold create would. The command runs under the default network policy while pooled:
//! a claim that sets another one cuts the connections it opened that the claimed policy
//! refuses, as every policy change does (`SandboxRuntime::cut_refused`), so they do not
//! outlive the claim (the rules accept established connections before the policy). A
//! create with env vars claims such a sandbox only if the template says its program
//! takes them from envd at run time (`TemplateConfig::late_env`: the code interpreter
//! reads `/envs` at a context's first execution); otherwise it is created cold, so a
//! start command always sees the env vars it was created with.
//!
//! In memory a pooled sandbox is an ordinary `Live` entry in state `running` with an end
//! time far away, plus membership in [`Pool`]; `Node::list`/`get` hide it. On disk its
//! record stays `creating`, so reconciliation after a crash destroys it like any
//! half-made sandbox. [`Node::close`](crate::Node::close) destroys the pool's sandboxes.
//!
//! Refill: one background task per node tops every pool up to its target, making as many
//! sandboxes at a time as the node makes cold creates (`create_concurrency`: twice the
//! cores, at least 4). Cold creates share that bounded FIFO semaphore with it, so a burst
//! of 50 creates does not thrash two cores. Making one sandbox is mostly waiting
//! (process starts, RCU grace periods in the network setup, envd starting), so more than
//! one per core overlap: on the two-core development VM, four at a time instead of two
//! cut a closed loop's misses from 30 to 8–10 in 200 creates (`docs/bench.md`). It runs
//! on the node's background thread at nice 19 (shared with asynchronous teardowns), and
//! so do the helper and sandbox processes it starts (the runtime gives a helper the
//! spawning thread's nice value, and the sandbox inherits the helper's; its cgroup's CPU
//! weight is scaled by the same nice, since a task's nice orders it only within its own
//! cgroup): making the next
//! pooled sandbox (about 10 ms of CPU) and removing the last one must not slow the claim
//! or that sandbox's first commands. A claim raises the
//! sandbox's tasks and cgroup back to nice 0 before `/init`, so its user's processes run at normal
//! priority. Right after a claim the refill also waits for a pause in claims
//! ([`REFILL_PAUSE`]) unless the pool is down to a quarter of its target or claims come
//! closer together than the pause (demand that the pause would only starve): a paced
//! create-run-kill cycle measured 1 ms faster per create when the next sandbox was not
//! being made at the same moment. While claims overlap (a burst of creates), it starts
//! nothing unless the pool ran dry, for at most `NodeConfig::refill_burst_hold`. The
//! target adapts: a create that finds its pool empty raises it by two (up to 4× the
//! configured size; `PoolState::missed`), a minute without misses lowers it back; the sum of
//! all pooled sandboxes' measured memory stays under `pool_memory_mb`. The create that
//! missed does not simply go cold: it waits for a cold create's turn or a sandbox a
//! refill under way makes ready, and takes whichever comes first
//! ([`Inner::claim_or_turn`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use cubicle_runtime::SandboxId;

use crate::envd_client::InitRequest;
use crate::error::{Error, Result};
use crate::node::create::CreatePlan;
use crate::node::idle_conn::IDLE_CONN_TTL;
use crate::node::inner::{
    Inner, blocking, born_init, init_after_birth, init_needed, now_ms, sandbox_env,
};
use crate::node::teardown::spawn_watcher;
use crate::sandbox::{CreateRequest, DeathReason, SandboxInfo, SandboxState};
use crate::template::Template;
use crate::{fsutil, ids};

pub(crate) mod shell;
mod state;

pub(crate) use state::Pool;
pub use state::PoolStats;

/// End time of a pooled sandbox (never reached; the claim sets the real one).
const POOLED_END_MS: u64 = 100 * 365 * 24 * 3600 * 1000;
/// Memory assumed per pooled sandbox before one could be measured.
const DEFAULT_EST_BYTES: u64 = 4 << 20;
/// Without misses for this long, a grown target shrinks back.
const SHRINK_AFTER: Duration = Duration::from_secs(60);
/// After a claim, refills wait for this long without claims (unless the pool is low).
const REFILL_PAUSE: Duration = Duration::from_millis(25);
/// How often a held refill looks whether the burst is over.
const BURST_POLL: Duration = Duration::from_millis(2);
/// Tries to remove each ready pooled sandbox when the node closes.
const DRAIN_ATTEMPTS: u32 = 3;
/// Nice value of the refill thread and of pooled sandboxes until claimed.
const REFILL_NICE: i32 = 19;

/// Whether `template` has a start command (or a readiness port) that a refill runs.
fn has_start(t: &Template) -> bool {
    t.config
        .start_command
        .as_deref()
        .is_some_and(|c| !c.trim().is_empty())
        || t.config.ready_port.is_some()
}

/// Whether a pooled sandbox of `t` may serve `req` (see the module comment).
fn claimable(t: &Template, req: &CreateRequest, disk_mb: u64) -> bool {
    req.id.is_none()
        && disk_mb == t.config.disk_mb
        && (req.internet || denies_everything(req))
        && (req.env_vars.is_empty() || !has_start(t) || t.config.late_env)
}

/// Whether `req` asks for no internet with a policy that refuses every destination
/// (E2B's `allow_internet_access: false`, or `denyOut` 0.0.0.0/0 with nothing allowed):
/// a pooled sandbox serves it by taking that policy on its interface before anyone can
/// use it (and cutting what its start command connected to).
/// Internet off with any other policy (the node's own "no network") stays cold.
fn denies_everything(req: &CreateRequest) -> bool {
    // A policy that needs no network is one that denies all and allows nothing.
    !req.internet && !req.network.needs_network()
}

/// A claimed sandbox's record, as create `req` (planned as `plan`, at `now`) asks:
/// its variables, metadata, times, limits, volumes and network. The access token stays
/// the one envd was born with: it never left the node before this claim hands it out.
pub(crate) fn claim_record(
    r: &mut crate::sandbox::SandboxRecord,
    req: &CreateRequest,
    plan: &CreatePlan,
    now: u64,
) {
    let timeout = plan.timeout.as_millis() as u64;
    r.env_vars = sandbox_env(&plan.template, &req.env_vars, &r.id);
    r.metadata = req.metadata.clone();
    r.created_at_ms = now;
    r.end_at_ms = now + timeout;
    r.timeout_ms = timeout;
    r.lifecycle = req.lifecycle;
    (r.memory_mb, r.cpus) = (plan.limits.0, plan.limits.1);
    r.volumes = req.volumes.clone();
    r.network = req.network.clone();
    r.mask_request_host = req.mask_request_host.clone();
}

/// What [`Inner::try_claim`] did.
// One per create, returned once: not worth a box.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Claim {
    /// Served from the pool (an error is the create's own: e.g. a volume being deleted).
    Served(Result<SandboxInfo>),
    /// The template's pool was empty.
    Empty,
    /// No pool serves this request, or the pooled sandbox failed its claim: create cold.
    No,
}

impl Inner {
    /// Serves `req` from the template's pool if it can. `after_miss`: a retry of a create
    /// that found the pool empty before ([`Inner::claim_or_turn`]), counted as waited,
    /// not as a claim or a second miss.
    pub(crate) async fn try_claim(
        self: &Arc<Self>,
        req: &CreateRequest,
        plan: &CreatePlan,
        after_miss: bool,
    ) -> Claim {
        let inner = self;
        let (template, limits) = (&plan.template, plan.limits);
        let name = &template.config.name;
        let defaults = (template.config.memory_mb, template.config.cpus);
        if !claimable(template, req, limits.2) {
            return Claim::No;
        }
        let _under_way = inner.pool.claiming();
        let t0 = Instant::now();
        // Take a ready one (skipping ids whose sandbox died meanwhile).
        let (record, born, init) = loop {
            let id = {
                let mut ps = inner.pool.lock();
                if !ps.target.contains_key(name) {
                    return Claim::No;
                }
                match ps.take(name, after_miss) {
                    Some(id) => id,
                    None if after_miss => return Claim::Empty,
                    None => {
                        let configured = inner.config.pool.get(name).copied().unwrap_or(0);
                        ps.missed(name, configured, Instant::now());
                        drop(ps);
                        inner.pool.wake.notify_one();
                        return Claim::Empty;
                    }
                }
            };
            let now = now_ms();
            let mut st = inner.lock();
            if let Err(e) = st.check_volumes_usable(&req.volumes) {
                // A volume is being deleted: the pooled sandbox goes back, unused.
                drop(st);
                inner.pool.lock().put_back(name, id);
                inner.pool.readied.notify_waiters();
                return Claim::Served(Err(e));
            }
            let Some(live) = st.live_mut().get_mut(&id) else {
                continue;
            };
            if live.record.state != SandboxState::Running {
                // Out of the pool's lists but still live: nothing drains it at close
                // (its `creating` record makes the next open remove it). A pooled
                // sandbox was once left running at a close for a reason no log said
                // (docs/bench.md, round 14); this is one path that would do it.
                tracing::warn!(
                    sandbox = %id,
                    state = ?live.record.state,
                    "a ready pooled sandbox was not running; skipped"
                );
                continue;
            }
            if live.record.layers != template.config.layers {
                // Made from an older build of the template (it was rebuilt since), or
                // the caller asked for another tag: not what this create wants.
                drop(st);
                let inner = self.clone();
                tokio::spawn(async move {
                    inner.finish(&id, DeathReason::Killed, false).await;
                });
                continue;
            }
            let init = live.init.clone();
            let born = born_init(&live.record);
            claim_record(&mut live.record, req, plan, now);
            break (live.record.clone(), born, init);
        };
        inner.pool.wake.notify_one();
        let id = record.id.clone();
        let claimed = inner
            .complete_claim(&record, born, init, plan, defaults, None)
            .await;
        if let Err(e) = claimed {
            tracing::warn!(sandbox = %id, "pooled sandbox failed its claim: {e}; creating cold");
            inner.clone().finish(&id, DeathReason::Exited, false).await;
            return Claim::No;
        }
        Claim::Served(Ok(inner.claimed_info(&record, t0)))
    }

    /// The claim of a ready sandbox whose record [`claim_record`] filled in: with
    /// `root_of`, a shell given that template's root and mounts first (`shell.rs`), else
    /// a pooled sandbox given its volumes (both at full CPU weight); then its limits (if
    /// not `defaults`, the memory and CPUs it was made with), network policy and, unless
    /// envd was `born` knowing all it must (`init_needed`), envd's `/init`; its record on
    /// disk says `running`.
    pub(crate) async fn complete_claim(
        self: &Arc<Self>,
        record: &crate::sandbox::SandboxRecord,
        born: Option<InitRequest>,
        init: Option<crate::sandbox::InitPidfd>,
        plan: &CreatePlan,
        defaults: (u64, u32),
        root_of: Option<&Template>,
    ) -> Result<()> {
        let inner = self;
        let id = record.id.clone();
        let limits = plan.limits;
        // Full CPU weight first: what the claim does in the sandbox's cgroup (a shell's
        // attach runs there) must not wait behind the refills at the pool's weight.
        inner.runtime.set_cpu_nice(&id, 0);
        if let Some(template) = root_of {
            // Its template's files, binds and volumes come with the root.
            let (binds, volumes) = inner.template_binds(record, template)?;
            let spec = inner.start_spec(record, template, binds, volumes);
            let rt = inner.runtime.clone();
            blocking(move || rt.attach_root(&spec)).await?;
        } else if !record.volumes.is_empty() {
            // Its namespaces exist already: the volumes are mounted into them.
            let binds = inner.volume_binds(&record.volumes)?;
            let init = init.ok_or_else(|| Error::SandboxNotFound(id.to_string()))?;
            let (rt, id2, pid, uid_base) = (
                inner.runtime.clone(),
                id.clone(),
                record.pid.unwrap_or(0),
                record.uid_base,
            );
            blocking(move || {
                use std::os::fd::AsFd;
                rt.attach_volumes(&id2, init.fd().as_fd(), pid, uid_base, &binds)
            })
            .await?;
        }
        if (limits.0, limits.1) != defaults {
            inner
                .runtime
                .set_limits(&id, limits.0, limits.1, inner.config.pids_limit)?;
        }
        if !record.network.is_plain_default() {
            // Pooled sandboxes are made with the default policy: set the asked one
            // before anyone can use the sandbox (a few set elements, no veth change).
            let rt = inner.runtime.clone();
            let (i2, slot, pid, p) = (
                id.clone(),
                record.slot,
                record.pid.unwrap_or(0),
                record.network.clone(),
            );
            // What a start command connected to and this policy refuses is cut.
            blocking(move || {
                rt.set_network(&i2, slot, pid, &p)?;
                rt.cut_refused(&i2, slot, &p)
            })
            .await?;
        }
        // Without variables asked, envd knows all of it from its birth: it is not woken
        // (its first request is the user's).
        let init = init_needed(born.as_ref(), record);
        inner.init_envd(record, init, Some(IDLE_CONN_TTL)).await?;
        let mut on_disk = record.clone();
        on_disk.state = SandboxState::Running;
        fsutil::rewrite_json(&inner.sandbox_dir(&id).join("sandbox.json"), &on_disk)?;
        Ok(())
    }

    /// What a create served by a claim answers (`claimed`), `t0` its start.
    pub(crate) fn claimed_info(
        &self,
        record: &crate::sandbox::SandboxRecord,
        t0: Instant,
    ) -> SandboxInfo {
        let id = &record.id;
        let ready_us = t0.elapsed().as_micros() as u64;
        let mut info = {
            let mut st = self.lock();
            match st.live_mut().get_mut(id) {
                Some(live) => {
                    live.ready_us = ready_us;
                    live.info(self.envd_socket(id))
                }
                None => SandboxInfo::from_record(record, self.envd_socket(id), ready_us),
            }
        };
        self.changed.notify_one();
        tracing::info!(sandbox = %id, template = %record.template, ready_us, "sandbox claimed from the pool");
        info.claimed = true;
        info
    }

    /// After a miss: waits for whichever comes first, a cold create's turn (returned) or
    /// a sandbox a refill under way makes ready (claimed: `Ok`). The turn is the same
    /// FIFO semaphore the refills hold while they make sandboxes, so a create that
    /// missed used to wait for a refill to end and then start a sandbox from nothing,
    /// while the one that refill had just made sat in the pool. Taking that one instead
    /// serves the create a cold create's time sooner and leaves the turn to the refills.
    pub(crate) async fn claim_or_turn(
        self: &Arc<Self>,
        req: &CreateRequest,
        plan: &CreatePlan,
    ) -> std::result::Result<Result<SandboxInfo>, Option<tokio::sync::OwnedSemaphorePermit>> {
        // Queued once: a wake-up for a sandbox someone else then claims must not send
        // this create to the back of the FIFO queue (in bursts of 50, re-queued waiters
        // starved for seconds).
        let turn = self.pool.create_permits.clone().acquire_owned();
        tokio::pin!(turn);
        loop {
            let readied = self.pool.readied.notified();
            tokio::pin!(readied);
            // Registered before the pool is looked at again: no push goes unnoticed.
            readied.as_mut().enable();
            match self.try_claim(req, plan, true).await {
                Claim::Served(r) => return Ok(r),
                Claim::No => return Err(None),
                Claim::Empty => {}
            }
            tokio::select! {
                biased;
                () = &mut readied => {}
                permit = &mut turn => return Err(permit.ok()),
            }
        }
    }

    /// Makes one pooled sandbox of `template` (internet on, the template's limits). Its
    /// exit watcher runs on `main` (the node's runtime), not on the refill thread's.
    async fn fill_one(
        self: &Arc<Self>,
        template: &Template,
        main: &tokio::runtime::Handle,
    ) -> Result<()> {
        let inner = self;
        let id = ids::new_sandbox_id();
        // A member before it is live, so `list` never shows a sandbox being made for the
        // pool. Not once the node is closed: checked under the pool's lock, so that either
        // `Node::wait_refills` (which reads the members after `close`) sees this one, or
        // this one sees the close (the refill loop's own check is a template lookup
        // earlier, and a close in between let a sandbox be made after the wait).
        {
            let mut ps = inner.pool.lock();
            if inner.closed.load(std::sync::atomic::Ordering::SeqCst) {
                return Ok(());
            }
            ps.add_member(id.clone());
        }
        // Born with the environment a claim that asks for no variables gives it (a shell
        // cannot be: its template is not known yet), so that such a claim need not tell
        // envd anything.
        let env_vars = if shell::is_shell(template) {
            BTreeMap::new()
        } else {
            sandbox_env(template, &BTreeMap::new(), &id)
        };
        let record = match inner.reserve(&id, template, None, |r| {
            r.end_at_ms = r.created_at_ms + POOLED_END_MS;
            r.env_vars = env_vars;
        }) {
            Ok(r) => r,
            Err(e) => {
                inner.pool.lock().remove_member(&id);
                return Err(e);
            }
        };
        let t0 = Instant::now();
        let started = match self.start_phase(record, template, t0).await {
            Ok(record) if has_start(template) => self.start_pooled_command(record, template).await,
            other => other,
        };
        match started {
            Ok(record) if inner.closed.load(std::sync::atomic::Ordering::SeqCst) => {
                let _ = record;
                // A member until it is gone: `Node::wait_refills` waits for that.
                inner.clone().finish(&id, DeathReason::Killed, true).await;
                inner.pool.lock().remove_member(&id);
                Ok(())
            }
            Ok(record) => {
                let pid = record.pid.unwrap_or(0);
                {
                    let mut st = inner.lock();
                    let Some(live) = st.live_mut().get_mut(&id) else {
                        return Err(Error::SandboxNotFound(id.to_string()));
                    };
                    // Running in memory (killable, watched); `creating` on disk.
                    live.init = inner.init_pidfd(&id, pid, record.pid_start_time);
                    live.record = record;
                    live.record.state = SandboxState::Running;
                    let _in_main = main.enter();
                    live.watcher = Some(spawn_watcher(
                        Arc::downgrade(inner),
                        id.clone(),
                        live.init.as_ref(),
                    ));
                }
                tracing::debug!(
                    sandbox = %id,
                    template = %template.config.name,
                    ms = t0.elapsed().as_secs_f64() * 1e3,
                    "pool: made"
                );
                // Ready only if the node is still open, checked under the pool's lock:
                // `Node::close` sets `closed` before its drain takes the ready lists, so
                // either the drain sees this one or this one sees the close. (Checked
                // only above, a close in between left a ready sandbox no drain would
                // see, running past its server's exit.)
                let mut ps = inner.pool.lock();
                if inner.closed.load(std::sync::atomic::Ordering::SeqCst) {
                    drop(ps);
                    inner.clone().finish(&id, DeathReason::Killed, true).await;
                    inner.pool.lock().remove_member(&id);
                    return Ok(());
                }
                ps.refills += 1;
                ps.ready
                    .entry(template.config.name.clone())
                    .or_default()
                    .push_back(id);
                drop(ps);
                inner.pool.readied.notify_waiters();
                Ok(())
            }
            Err(e) => {
                // A member until it is gone (as above): a start that failed because the
                // node closed meanwhile is what `Node::wait_refills` waits for.
                inner.clone().finish(&id, DeathReason::Exited, true).await;
                inner.pool.lock().remove_member(&id);
                Err(e)
            }
        }
    }

    /// For a template with a start command: envd knows the sandbox's own variables (from
    /// its birth, or else an `/init` tells it), then the start command runs and its
    /// readiness port answers, as in a cold create.
    async fn start_pooled_command(
        &self,
        record: crate::sandbox::SandboxRecord,
        template: &Template,
    ) -> Result<crate::sandbox::SandboxRecord> {
        let init = init_after_birth(&record);
        self.init_envd(&record, init, None).await?;
        let pid = record.pid.unwrap_or(0);
        self.start_template_command(&record, template, pid).await?;
        Ok(record)
    }

    /// Destroys every unclaimed pooled sandbox (blocking; used by `close`).
    pub(crate) fn drain_pool_blocking(&self) {
        let inner = self;
        // Only ready ones: a sandbox still being made is its refill's to remove (it sees
        // the node closed); if the process exits first, its `creating` record makes the
        // next open destroy it.
        let ids: Vec<SandboxId> = {
            let mut ps = inner.pool.lock();
            ps.target.clear();
            let ids: Vec<SandboxId> = std::mem::take(&mut ps.ready)
                .into_values()
                .flatten()
                .collect();
            for id in &ids {
                ps.remove_member(id);
            }
            ids
        };
        for id in ids {
            if let Some(slot) = inner.remove_unclaimed_blocking(&id) {
                inner.lock().slots.release(slot);
            }
        }
    }

    /// Destroys ready pooled sandbox or shell `id`, already taken out of the pool
    /// (blocking); returns its slot, still marked used, for the caller to release or
    /// reuse; `None` if it was not there or could not be removed.
    fn remove_unclaimed_blocking(&self, id: &SandboxId) -> Option<u32> {
        let live = self.lock().live_mut().remove(id)?;
        if let Some(w) = &live.watcher {
            w.abort();
        }
        let dir = self.sandbox_dir(id);
        let slot = live.record.slot;
        // A few tries, as a teardown of a user's sandbox is retried: on a loaded host
        // emptying its cgroup can outlast one deadline.
        for attempt in 1..=DRAIN_ATTEMPTS {
            let ok = self
                .runtime
                .destroy(id, Some(slot), &dir)
                .and_then(|_| self.runtime.remove_dir(id, &dir));
            match ok {
                Ok(()) => return Some(slot),
                // Its record says `creating`: after the last try, the next open
                // destroys it.
                Err(e) => tracing::warn!(
                    sandbox = %id,
                    "pooled sandbox teardown failed (try {attempt} of {DRAIN_ATTEMPTS}): {e}"
                ),
            }
        }
        None
    }

    /// Makes room for a create that the pools could not serve when every slot is taken:
    /// removes one ready sandbox of the pool (or the shells) with the most ready, so
    /// that what the node made ahead never refuses a create it could otherwise make, and
    /// returns its slot, still marked used, for that create ([`Inner::reserve`]): the
    /// refill cannot take it in between, and does not start while the slots are full.
    pub(crate) async fn make_room(self: &Arc<Self>) -> Option<u32> {
        if self.lock().slots.free() > 0 {
            return None;
        }
        let id = self.pool.lock().evict_oldest()?;
        let inner = self.clone();
        let slot = blocking(move || Ok(inner.remove_unclaimed_blocking(&id)))
            .await
            .ok()
            .flatten();
        tracing::info!(
            made_room = slot.is_some(),
            "every sandbox slot was taken: a pooled sandbox was removed for a create"
        );
        slot
    }
}

/// How long a measured estimate is reused (measuring reads one cgroup file per pooled
/// sandbox: 64 file reads on every turn of the refill loop showed in profiles).
const ESTIMATE_TTL: Duration = Duration::from_secs(1);

/// Estimated host memory of one pooled sandbox (the measured average, else a default),
/// measured at most once per [`ESTIMATE_TTL`].
fn estimate(inner: &Inner) -> u64 {
    if let Some((est, at)) = inner.pool.lock().estimate
        && at.elapsed() < ESTIMATE_TTL
    {
        return est;
    }
    let est = measure_estimate(inner);
    inner.pool.lock().estimate = Some((est, Instant::now()));
    est
}

fn measure_estimate(inner: &Inner) -> u64 {
    let ids: Vec<SandboxId> = inner.pool.lock().member_ids();
    let used: Vec<u64> = ids
        .iter()
        .filter_map(|id| inner.runtime.memory_usage(id))
        .collect();
    if used.is_empty() {
        DEFAULT_EST_BYTES
    } else {
        (used.iter().sum::<u64>() / used.len() as u64).max(1 << 20)
    }
}

/// Starts the node's background thread ("cubicle-bg", nice [`REFILL_NICE`], a
/// single-threaded runtime whose handle goes to `Pool::background`): it runs [`refill`]
/// when pools are configured, and the asynchronous teardowns `Node::kill` hands it. Once
/// the node is closed it stays until those teardowns are done (at most a minute). Must
/// be called within the node's runtime. Without it (thread or runtime creation failed)
/// teardowns run on the node's runtime and pools stay empty.
pub(crate) fn start_background(inner: &Arc<Inner>) {
    let weak = Arc::downgrade(inner);
    let main = tokio::runtime::Handle::current();
    let pools = !inner.config.pool.is_empty();
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("cubicle-bg".into())
        .spawn(move || {
            // SAFETY: no memory arguments. Who 0 = the calling thread: Linux keeps nice
            // per thread, and threads and processes started from here inherit it.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, REFILL_NICE) };
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!("background runtime: {e}; pools stay empty");
                    return;
                }
            };
            let _ = tx.send(rt.handle().clone());
            rt.block_on(async move {
                if pools {
                    refill(weak.clone(), main).await;
                }
                use std::sync::atomic::Ordering::SeqCst;
                let mut closed_at: Option<Instant> = None;
                loop {
                    let Some(inner) = weak.upgrade() else { return };
                    let closed = inner.closed.load(SeqCst);
                    let pending = inner.pool.teardowns.load(SeqCst) > 0;
                    drop(inner);
                    if closed {
                        let since = closed_at.get_or_insert_with(Instant::now);
                        if !pending || since.elapsed() > Duration::from_secs(60) {
                            return;
                        }
                    }
                    let nap = if closed { 20 } else { 250 };
                    tokio::time::sleep(Duration::from_millis(nap)).await;
                }
            });
        });
    match spawned {
        Ok(_) => {
            if let Ok(h) = rx.recv() {
                let _ = inner.pool.background.set(h);
            }
        }
        Err(e) => tracing::error!("background thread: {e}; pools stay empty"),
    }
}

/// The refill task: tops pools up to their targets, as many sandboxes at a time as the
/// node makes cold creates at once (`NodeConfig::create_concurrency`).
async fn refill(weak: Weak<Inner>, main: tokio::runtime::Handle) {
    let mut failures = 0u32;
    // Sandboxes being made, at most `create_concurrency`. Never dropped with one in
    // flight (that would cancel it halfway): a close waits for them, and each removes
    // its own sandbox when it sees the close.
    let mut making: tokio::task::JoinSet<Result<()>> = tokio::task::JoinSet::new();
    // Which template each one in flight is for (not a member until it has started).
    let mut inflight: HashMap<tokio::task::Id, String> = HashMap::new();
    // Since when claims have overlapped (a burst), while the refill holds off.
    let mut burst_since: Option<Instant> = None;
    loop {
        while let Some(done) = making.try_join_next_with_id() {
            if let Some(wait) = refill_done(done, &mut inflight, &mut failures) {
                tokio::time::sleep(wait).await;
            }
        }
        let Some(inner) = weak.upgrade() else {
            while making.join_next().await.is_some() {}
            return;
        };
        if inner.closed.load(std::sync::atomic::Ordering::SeqCst) {
            drop(inner);
            while making.join_next().await.is_some() {}
            return;
        }
        // Which template needs one most (fewest ready relative to its target)?
        let budget = inner.config.pool_memory_mb.saturating_mul(1 << 20);
        let est = estimate(&inner);
        let want = {
            let mut ps = inner.pool.lock();
            let members = ps.member_count() as u64;
            let configured = inner.config.pool.clone();
            let now = Instant::now();
            for (name, t) in ps.target.clone() {
                let base = configured.get(&name).copied().unwrap_or(0);
                let stale = ps
                    .last_miss
                    .get(&name)
                    .is_none_or(|m| now.duration_since(*m) > SHRINK_AFTER);
                if t > base && stale {
                    ps.target.insert(name, base);
                }
            }
            // In flight counts as made: a refill just spawned is not a member yet.
            let in_flight = |n: &str| inflight.values().filter(|v| *v == n).count();
            if making.len() >= inner.config.create_concurrency.max(1)
                || (members + making.len() as u64 + 1) * est > budget
            {
                None
            } else {
                ps.target
                    .iter()
                    .map(|(n, t)| {
                        let r = ps.ready.get(n).map_or(0, VecDeque::len) + in_flight(n);
                        (n.clone(), *t, r)
                    })
                    .filter(|(_, t, r)| r < t)
                    .min_by_key(|(_, t, r)| (r * 1000) / (*t).max(1))
                    .map(|(n, _, _)| n)
            }
        };
        // Every slot taken (by sandboxes, pooled ones and those in flight): a refill would
        // only fail, and creates take the pool's sandboxes' slots (`make_room`). Read only
        // when one is wanted: the node's lock is the claims' too.
        let want = want.filter(|_| inner.lock().slots.free() > 0);
        let wake = inner.pool.wake.clone();
        // Yield to creates in flight: right after a claim, making the next sandbox (a
        // core's worth of CPU for ~10 ms, and kernel locks shared with the claimed
        // sandbox's first commands) waits for a pause, unless the pool is running low.
        // Claims back to back (closer than the pause) are demand the pause would only
        // starve: a closed loop of creates drained three quarters of a pool of 64 before
        // the first refill.
        let pause = {
            let ps = inner.pool.lock();
            want.as_ref().and_then(|n| {
                let ready = ps.ready.get(n).map_or(0, VecDeque::len);
                let low = ps.target.get(n).map_or(0, |t| t / 4);
                let since = ps.last_claim?.elapsed();
                let busy = ps.claim_gap.is_some_and(|g| g < REFILL_PAUSE);
                (ready > low && !busy && since < REFILL_PAUSE).then(|| REFILL_PAUSE - since)
            })
        };
        if let Some(left) = pause {
            drop(inner);
            tokio::time::sleep(left).await;
            continue;
        }
        // Claims overlapping are a burst of creates: a sandbox started now would be ready
        // only after it and takes CPU from every claim of it (at nice 19 still: the
        // `cubicle` cgroup it starts in competes with the server at full weight). So the
        // refill holds off while they overlap, unless its pool ran dry (creates then wait
        // for refills) or for longer than the hold (a steady concurrent load is
        // demand, as back-to-back claims are; `NodeConfig::refill_burst_hold`).
        let overlapping = inner.pool.claims_under_way() >= 2;
        // The pool's lock only in a burst (this loop runs on every wake-up).
        let dry = overlapping
            && want.as_ref().is_some_and(|n| {
                let ps = inner.pool.lock();
                ps.ready.get(n).is_none_or(VecDeque::is_empty)
            });
        if !overlapping || dry {
            burst_since = None;
        } else if want.is_some()
            && burst_since.get_or_insert_with(Instant::now).elapsed()
                < inner.config.refill_burst_hold
        {
            drop(inner);
            tokio::time::sleep(BURST_POLL).await;
            continue;
        }
        let Some(name) = want else {
            // Teardowns that waited for the refill go on (`Pool::yield_to_refill`).
            inner.pool.refilled.notify_waiters();
            drop(inner);
            tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                Some(done) = making.join_next_with_id() => {
                    if let Some(wait) = refill_done(done, &mut inflight, &mut failures) {
                        tokio::time::sleep(wait).await;
                    }
                }
            }
            continue;
        };
        // Only built templates: building is the server's (or the first create's) job, and
        // two builds of one template must not race.
        let store = inner.templates.clone();
        let n2 = name.clone();
        let lookup = move || match n2 == shell::SHELL_POOL {
            true => Ok(Some(shell::shell_template())),
            false => store.get(&n2),
        };
        let template = match tokio::task::spawn_blocking(lookup).await {
            Ok(Ok(Some(t))) => t,
            Ok(Ok(None)) => {
                drop(inner);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            Ok(Err(e)) => {
                tracing::warn!(template = %name, "pool: {e}");
                inner.pool.lock().target.remove(&name);
                continue;
            }
            Err(_) => return,
        };
        let permits = inner.pool.create_permits.clone();
        let Ok(permit) = permits.acquire_owned().await else {
            while making.join_next().await.is_some() {}
            return;
        };
        let main = main.clone();
        let task = making.spawn(async move {
            let r = inner.fill_one(&template, &main).await;
            drop(permit);
            r
        });
        inflight.insert(task.id(), name);
    }
}

/// Books a finished refill; after a failure, how long to back off (capacity, a broken
/// template: the wait doubles with each failure in a row).
fn refill_done(
    done: std::result::Result<(tokio::task::Id, Result<()>), tokio::task::JoinError>,
    inflight: &mut HashMap<tokio::task::Id, String>,
    failures: &mut u32,
) -> Option<Duration> {
    let (id, result) = match done {
        Ok((id, r)) => (id, r.map_err(|e| e.to_string())),
        Err(e) => (e.id(), Err(format!("refill task failed: {e}"))),
    };
    let name = inflight.remove(&id).unwrap_or_default();
    match result {
        Ok(()) => {
            *failures = 0;
            None
        }
        Err(e) => {
            *failures += 1;
            tracing::warn!(template = %name, "pool refill failed: {e}");
            Some(Duration::from_millis(100 << (*failures).min(6)))
        }
    }
}

/// Parses `tiny=4,base=8` (the `--pool` flag).
pub fn parse_pool_spec(s: &str) -> std::result::Result<BTreeMap<String, usize>, String> {
    let mut m = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, n) = part
            .split_once('=')
            .ok_or_else(|| format!("pool entry {part:?} is not TEMPLATE=N"))?;
        let n: usize = n
            .trim()
            .parse()
            .map_err(|_| format!("pool size {n:?} of {name} is not a number"))?;
        if name.trim().is_empty() || n > 4096 {
            return Err(format!("bad pool entry {part:?}"));
        }
        if n > 0 {
            m.insert(name.trim().to_string(), n);
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_specs_parse() {
        let m = parse_pool_spec("tiny=4, base=8,x=0").unwrap();
        assert_eq!(m.get("tiny"), Some(&4));
        assert_eq!(m.get("base"), Some(&8));
        assert!(!m.contains_key("x"));
        assert!(parse_pool_spec("tiny").is_err());
        assert!(parse_pool_spec("tiny=a").is_err());
        assert!(parse_pool_spec("").unwrap().is_empty());
    }

    #[test]
    fn internet_off_claims_with_a_policy_that_refuses_everything() {
        let mut t = super::shell::shell_template();
        let disk = t.config.disk_mb;
        let off = CreateRequest {
            internet: false,
            network: cubicle_egress::NetworkPolicy {
                deny_out: vec!["0.0.0.0/0".parse().unwrap()],
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(claimable(&t, &off, disk));
        // With a start command too (the claim cuts what it connected to that the policy
        // refuses).
        t.config.start_command = Some("serve".into());
        assert!(claimable(&t, &off, disk));
        // Internet off that still allows a destination needs a network a pooled
        // sandbox would keep: cold.
        let some = CreateRequest {
            network: cubicle_egress::NetworkPolicy {
                allow_out: vec!["192.0.2.1".parse().unwrap()],
                ..off.network.clone()
            },
            ..off.clone()
        };
        assert!(!claimable(&t, &some, disk));
        // The node's own "no network" (internet off, no policy): cold.
        let bare = CreateRequest {
            internet: false,
            ..Default::default()
        };
        assert!(!claimable(&t, &bare, disk));
        let on = CreateRequest {
            internet: true,
            ..Default::default()
        };
        assert!(claimable(&t, &on, disk));
    }
}
