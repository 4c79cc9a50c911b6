//! [`LinuxRuntime`]: the node's [`SandboxRuntime`] on top of `cubicle-runtime`
//! (namespaces, overlay rootfs, cgroups, seccomp — [`cubicle_runtime::spawn`]) and its
//! network module (veth + nftables, addressed by the node's slot).
//!
//! It keeps the [`cubicle_runtime::Sandbox`] handle of every sandbox it started or
//! adopted: the handle reaps the init (which is this process's child) on destroy.
//! Sandbox directories come from the runtime's storage module: each is a directory with
//! a hard disk quota (XFS project quota, or a btrfs subvolume with a qgroup limit) on a
//! filesystem mounted at `<state>/sandboxes` (a loop-mounted image when the host's
//! filesystem has no quotas). Without quota support the node still works, unlimited.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::held_netns::HeldNamespaces;
use cubicle_egress::{Egress, EgressConfig, NetEvent};
use cubicle_runtime::network::{Netns, Network, NetworkConfig};
use cubicle_runtime::storage::{Storage, StorageConfig};
use cubicle_runtime::{Cgroup, Limits, Sandbox, SandboxId, SandboxSpec};

use crate::config::NodeConfig;
use crate::error::{Error, Result};
use crate::init_log::{INIT_PIPE, InitLogs};
use crate::runtime::{SandboxRuntime, StartSpec, Started};
use crate::sandbox::{DeathReason, NetworkPolicy};
use crate::writeback::Writeback;

/// The Linux isolation layer.
pub struct LinuxRuntime {
    sandboxes: Mutex<HashMap<String, Sandbox>>,
    /// CRIU for checkpoints; `Err` (logged) says why there are none on this host.
    criu: std::result::Result<cubicle_checkpoint::Criu, String>,
    /// `None` when the host network could not be prepared (then only `internet: false`
    /// sandboxes can be created); the error says why.
    network: std::result::Result<Network, String>,
    /// The egress layer (resolver, proxy, audit trails); present whenever `network` is.
    egress: Option<Egress>,
    /// Disk quotas; `Err` (logged) when the host cannot provide them.
    storage: std::result::Result<Storage, String>,
    /// Drains every sandbox's PID 1 output into its `init.log`.
    logs: InitLogs,
    /// Network namespaces of sandboxes killed ahead of their teardown, by slot
    /// ([`SandboxRuntime::hold_network`]): held until `destroy` has read their counters.
    held: HeldNamespaces,
    /// Syncs the sandboxes' filesystem at most once a second after sandboxes were made or
    /// ended (their overlays are volatile: see `writeback.rs`).
    writeback: Arc<Writeback>,
}

fn rt_err(what: &str, source: cubicle_runtime::Error) -> Error {
    Error::Isolation {
        what: what.to_string(),
        source,
    }
}

impl LinuxRuntime {
    /// Prepare the host: the network's nftables tables and IPv4 forwarding, and the
    /// egress layer (resolver, proxy) on the current tokio runtime. A network failure is
    /// not fatal (sandboxes without internet still work); it is logged.
    pub fn init(config: &NodeConfig) -> Result<Self> {
        let state_dir = config.state_dir.as_path();
        let opts = &config.network;
        let netcfg = NetworkConfig {
            allow_smtp: opts.allow_smtp,
            limits: opts.limits.clone(),
            ..NetworkConfig::default()
        };
        let mut network = Network::init(netcfg).map_err(|e| e.to_string());
        let mut egress = None;
        if let Ok(net) = &network {
            let started = tokio::runtime::Handle::try_current()
                .map_err(|e| e.to_string())
                .and_then(|handle| {
                    let mut ec = EgressConfig::new(
                        opts.dns_port,
                        opts.proxy_port,
                        net.address_guard(),
                        state_dir.join("logs"),
                    );
                    if !opts.upstream_dns.is_empty() {
                        ec.upstream_dns = opts.upstream_dns.clone();
                    }
                    ec.ca_dir = Some(state_dir.to_path_buf());
                    ec.upstream_ca = opts.upstream_ca.clone();
                    Egress::start(ec, &handle).map_err(|e| e.to_string())
                });
            match started {
                Ok(e) => {
                    let eg = e.clone();
                    match net.watch_events(move |ev| eg.record_kernel(ev)) {
                        Ok(w) => e.keep_watch(w),
                        Err(err) => tracing::warn!(
                            "the audit trail will miss connections that do not pass the egress proxy: {err}"
                        ),
                    }
                    egress = Some(e);
                }
                Err(e) => network = Err(format!("the egress layer did not start: {e}")),
            }
        }
        if let Err(e) = &network {
            tracing::warn!("sandbox networking unavailable: {e}");
        }
        let storage = Storage::open_with(StorageConfig {
            recycle: config.recycle_quota_dirs,
            ..StorageConfig::new(state_dir)
        })
        .map_err(|e| {
            tracing::warn!("disk quotas unavailable, sandboxes get unlimited disk: {e}");
            e.to_string()
        });
        let criu = cubicle_checkpoint::Criu::open(state_dir).map_err(|e| {
            tracing::warn!("pause, snapshots and forks unavailable: {e}");
            e.to_string()
        });
        let logs = InitLogs::start()
            .map_err(|e| Error::Runtime(format!("starting the init log drainer: {e}")))?;
        let writeback = Writeback::start(state_dir.join("sandboxes"))
            .map_err(|e| Error::Runtime(format!("starting the writeback thread: {e}")))?;
        Ok(LinuxRuntime {
            sandboxes: Mutex::new(HashMap::new()),
            criu,
            network,
            egress,
            storage,
            logs,
            held: HeldNamespaces::default(),
            writeback,
        })
    }

    /// The egress layer, when networking works.
    pub fn egress(&self) -> Option<&Egress> {
        self.egress.as_ref()
    }

    /// Makes this node's egress layer the one that answers the sandboxes on `slots` (the
    /// node's lease): DNS and steered TCP from their addresses are redirected to its
    /// resolver and proxy.
    pub fn serve_slots(&self, slots: std::ops::Range<u32>) -> Result<()> {
        let (Ok(net), Some(eg)) = (&self.network, &self.egress) else {
            return Ok(());
        };
        net.serve_slots(slots, eg.dns_addr().port(), eg.proxy_addr().port())
            .map_err(|e| rt_err("network redirect table", e))
    }

    /// Sets the kernel's share of `policy` for `slot` and registers the sandbox with the
    /// egress layer (which needs every sandbox that has a network interface).
    fn apply_policy(&self, id: &str, slot: u32, policy: &NetworkPolicy) -> Result<()> {
        let net = self.network()?;
        net.set_policy(slot, &policy.kernel())
            .map_err(|e| rt_err("network policy", e))?;
        let ip = net
            .slot_info(slot)
            .map_err(|e| rt_err("network policy", e))?
            .sandbox_ip;
        if let Some(eg) = &self.egress {
            eg.register(ip, id, policy.clone());
        }
        Ok(())
    }

    /// Which quota mechanism is in use, if any.
    pub fn quota_backend(&self) -> Option<cubicle_runtime::storage::QuotaBackend> {
        self.storage.as_ref().ok().map(Storage::backend)
    }

    fn handles(&self) -> std::sync::MutexGuard<'_, HashMap<String, Sandbox>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn network(&self) -> Result<&Network> {
        // The runtime's error was logged when the node opened; its text is all that is kept.
        self.network
            .as_ref()
            .map_err(|e| Error::Runtime(format!("sandbox networking unavailable: {e}")))
    }
}

/// The runtime's spec of the sandbox the node describes.
fn sandbox_spec(s: &StartSpec) -> SandboxSpec {
    let mut spec = SandboxSpec::new(
        s.id.as_str(),
        &s.rootfs,
        &s.sandbox_dir,
        s.uid_base,
        s.init.clone(),
    );
    spec.layers = s.layers.clone();
    spec.shell = s.shell;
    spec.uid_count = s.uid_count;
    spec.hostname = s.hostname.clone();
    spec.limits = Limits {
        memory_bytes: s.memory_mb << 20,
        cpu_millis: s.cpus.saturating_mul(1000),
        pids: s.pids,
    };
    spec.internet = s.internet;
    spec.env = s.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    spec.envd_binary = Some(s.envd_binary.clone());
    spec.ctl_socket = Some(s.ctl_socket.clone());
    spec.init_log = Some(s.sandbox_dir.join(INIT_PIPE));
    spec.binds = s
        .binds
        .iter()
        .map(|(source, target, readonly)| cubicle_runtime::BindMount {
            source: source.clone(),
            target: target.clone(),
            readonly: *readonly,
            idmapped: false,
        })
        .chain(
            s.volumes
                .iter()
                .map(|(source, target, readonly)| cubicle_runtime::BindMount {
                    source: source.clone(),
                    target: target.clone(),
                    readonly: *readonly,
                    idmapped: true,
                }),
        )
        .collect();
    spec
}

fn ck_err(what: String, source: cubicle_checkpoint::Error) -> Error {
    Error::Checkpoint { what, source }
}

/// The runtime-private facts of a started sandbox (its addresses, how long it took).
fn started_state(
    timings: &[(String, std::time::Duration)],
    net: Option<&cubicle_runtime::network::NetInfo>,
) -> serde_json::Value {
    let mut state = serde_json::json!({ "timingsUs": timings.iter()
        .map(|(k, d)| (k.clone(), serde_json::Value::from(d.as_micros() as u64)))
        .collect::<serde_json::Map<_, _>>() });
    if let Some(info) = net {
        state["hostIfname"] = info.host_ifname.clone().into();
        state["sandboxIp"] = info.sandbox_ip.to_string().into();
        state["gateway"] = info.gateway.to_string().into();
    }
    state
}

impl LinuxRuntime {
    fn criu(&self) -> Result<&cubicle_checkpoint::Criu> {
        self.criu
            .as_ref()
            .map_err(|e| Error::Unsupported(format!("this node cannot checkpoint sandboxes: {e}")))
    }

    /// The quota filesystem, which volumes and snapshots need (without it there are
    /// none).
    fn storage(&self) -> Result<&Storage> {
        self.storage.as_ref().map_err(|e| {
            Error::Unsupported(format!(
                "volumes and snapshots need the quota filesystem, which is unavailable: {e}"
            ))
        })
    }

    /// Kills what is left of the sandbox (after a checkpoint that ended it: nothing but
    /// the init to reap), removes its cgroup and network objects; its directory stays.
    fn release(&self, id: &str, slot: u32) -> Result<()> {
        let handle = self.handles().remove(id);
        let held = self.take_held(slot, handle.as_ref());
        if let Some(sb) = handle {
            // This reaps the init (our child) and waits for the cgroup to empty.
            sb.kill().map_err(|e| rt_err(&format!("stop {id}"), e))?;
        }
        let cg = Cgroup::handle(id).map_err(|e| rt_err("cgroup", e))?;
        cg.kill_all().map_err(|e| rt_err("cgroup", e))?;
        cg.remove().map_err(|e| rt_err("cgroup", e))?;
        let never_sent = self.never_sent(slot);
        self.detach_network(slot, never_sent)?;
        drop(held);
        Ok(())
    }

    /// The network namespace of `slot`'s sandbox, held since [`SandboxRuntime::hold_network`]
    /// or now from its live handle `sb`: kept until its processes are gone, so that its
    /// veth (and so its counters) outlives them.
    fn take_held(&self, slot: u32, sb: Option<&Sandbox>) -> Option<Netns> {
        // Without the host network there is no veth to keep, nor counter to read.
        self.network.as_ref().ok()?;
        self.held
            .take(slot)
            .or_else(|| sb.and_then(|sb| Netns::of_process(sb.pid(), sb.pidfd()).ok()))
    }

    /// Whether `slot`'s sandbox never sent a packet: final once its processes are gone
    /// and its namespace is held ([`Self::take_held`]; see `Network::never_sent`).
    fn never_sent(&self, slot: u32) -> bool {
        self.network.as_ref().is_ok_and(|net| net.never_sent(slot))
    }

    /// Forgets `slot`'s egress policy and removes its network objects (its connections
    /// too, unless the sandbox `never_sent` a packet).
    fn detach_network(&self, slot: u32, never_sent: bool) -> Result<()> {
        let Ok(net) = &self.network else {
            return Ok(());
        };
        if let (Some(eg), Ok(info)) = (&self.egress, net.slot_info(slot))
            && eg.policy_of(info.sandbox_ip).is_some()
        {
            eg.unregister(info.sandbox_ip);
        }
        net.detach_with(slot, never_sent)
            .map_err(|e| rt_err(&format!("network detach of slot {slot}"), e))
    }
}

impl Drop for LinuxRuntime {
    fn drop(&mut self) {
        // The egress tasks hold its sockets: stop them, so that a later node in this
        // process can bind the same ports.
        if let Some(eg) = &self.egress {
            eg.shutdown();
        }
    }
}

impl SandboxRuntime for LinuxRuntime {
    fn start(&self, s: &StartSpec) -> Result<Started> {
        let spec = sandbox_spec(s);
        if s.internet {
            // Fail before spawning if the network cannot work at all.
            self.network()?;
        }
        let t0 = std::time::Instant::now();
        let sb = cubicle_runtime::spawn(&spec).map_err(|e| rt_err("spawn", e))?;
        self.writeback.note();
        let t_spawn = t0.elapsed();
        if let Some(fifo) = sb.take_init_log() {
            self.logs
                .add(&s.id, fifo, s.sandbox_dir.join(crate::init_log::INIT_LOG));
        }
        let pid = sb.pid();
        let mut net_info = None;
        if s.internet {
            let attach = self.network().and_then(|net| {
                let ns = Netns::from_pid(pid).map_err(|e| rt_err("netns", e))?;
                net.attach_spawned(&ns, s.slot)
                    .map_err(|e| rt_err("network attach", e))
            });
            let attach =
                attach.and_then(|info| self.apply_policy(&s.id, s.slot, &s.network).map(|()| info));
            match attach {
                Ok(info) => net_info = Some(info),
                Err(e) => {
                    let _ = sb.destroy();
                    if let Ok(net) = self.network() {
                        let _ = net.detach(s.slot);
                    }
                    return Err(e);
                }
            }
        }
        tracing::debug!(
            sandbox = %s.id,
            spawn_us = t_spawn.as_micros() as u64,
            attach_us = (t0.elapsed() - t_spawn).as_micros() as u64,
            steps = ?sb.timings().iter().map(|(n, d)| format!("{n}={}", d.as_micros())).collect::<Vec<_>>(),
            "runtime start"
        );
        let state = started_state(sb.timings(), net_info.as_ref());
        self.handles().insert(s.id.to_string(), sb);
        Ok(Started { pid, state })
    }

    fn adopt(&self, id: &str, sandbox_dir: &Path) -> Result<i32> {
        let sb = Sandbox::adopt(id, sandbox_dir).map_err(|e| rt_err("adopt", e))?;
        // Its init log FIFO, opened again (a sandbox started before init logs were FIFOs
        // has none: its PID 1 still writes init.log itself).
        match cubicle_runtime::open_init_log(&sandbox_dir.join(INIT_PIPE)) {
            Ok(fifo) => self
                .logs
                .add(id, fifo, sandbox_dir.join(crate::init_log::INIT_LOG)),
            Err(e) => tracing::debug!(sandbox = %id, "no init log FIFO to reopen: {e}"),
        }
        let pid = sb.pid();
        self.handles().insert(id.to_string(), sb);
        Ok(pid)
    }

    fn hold_network(&self, id: &str, slot: u32) {
        if self.network.is_err() {
            // No veth to keep, nor counter to read.
            return;
        }
        if !self.held.has_room() {
            // A kill storm: this one's teardown walks conntrack instead (held_netns.rs).
            return;
        }
        let ns = {
            let handles = self.handles();
            let Some(sb) = handles.get(id) else {
                return;
            };
            match Netns::of_process(sb.pid(), sb.pidfd()) {
                Ok(ns) => ns,
                Err(_) => return,
            }
        };
        self.held.hold(slot, ns);
    }

    fn destroy(&self, id: &str, slot: Option<u32>, sandbox_dir: &Path) -> Result<()> {
        let handle = self.handles().remove(id);
        let held = slot.and_then(|slot| self.take_held(slot, handle.as_ref()));
        // With quotas, `remove_dir` removes the whole directory at once (a btrfs
        // subvolume in O(1)): no need to walk the layers first.
        let layers = self.storage.is_err().then_some(sandbox_dir);
        let res = match handle {
            Some(sb) if layers.is_some() => sb.destroy(),
            Some(sb) => sb.stop(),
            None if SandboxId::is_valid(id) => {
                match cubicle_runtime::remove_leftovers(id, layers) {
                    Err(cubicle_runtime::Error::NotFound(_)) => Ok(()),
                    other => other,
                }
            }
            None => Ok(()),
        };
        res.map_err(|e| rt_err(&format!("destroy {id}"), e))?;
        // Its overlay was unmounted without a sync, and its directory goes next.
        self.writeback.note();
        // Its processes are gone: what its FIFO still holds is its last output.
        self.logs.remove(id);
        if let Some(slot) = slot {
            // Nothing in it can send any more: the counter is final (the held namespace
            // keeps its veth).
            let never_sent = self.never_sent(slot);
            self.detach_network(slot, never_sent)?;
        }
        drop(held);
        // Nothing of the sandbox should be mounted on the host; be sure anyway.
        crate::fsutil::unmount_all_under(sandbox_dir);
        Ok(())
    }

    fn create_dir(&self, id: &str, dir: &Path, disk_mb: u64) -> Result<()> {
        match &self.storage {
            Ok(st) => {
                let id = SandboxId::parse(id).map_err(|e| rt_err("sandbox directory", e))?;
                let made = st
                    .create_sandbox_dir(&id, disk_mb << 20)
                    .map_err(|e| rt_err("sandbox directory", e))?;
                if made != dir && std::fs::canonicalize(dir).ok().as_deref() != Some(made.as_path())
                {
                    let _ = st.remove_sandbox_dir(&id);
                    return Err(Error::Runtime(format!(
                        "storage made {} but the node expects {}",
                        made.display(),
                        dir.display()
                    )));
                }
                Ok(())
            }
            Err(_) => std::fs::create_dir_all(dir).map_err(|e| Error::io("mkdir", dir, e)),
        }
    }

    fn remove_dir(&self, id: &str, dir: &Path) -> Result<()> {
        crate::fsutil::unmount_all_under(dir);
        match &self.storage {
            Ok(st) if let Ok(id) = SandboxId::parse(id) => {
                st.remove_sandbox_dir(&id)
                    .map_err(|e| rt_err(&format!("removing {}", dir.display()), e))?;
                // A recycled directory is reused once its emptying is committed.
                self.writeback.note();
                Ok(())
            }
            _ => Ok(crate::fsutil::remove_tree(dir)?),
        }
    }

    fn reconcile_storage(&self, known: &[String]) -> Result<()> {
        match &self.storage {
            Ok(st) => {
                let known: Vec<&str> = known.iter().map(String::as_str).collect();
                st.reconcile(&known)
                    .map_err(|e| rt_err("storage reconcile", e))
            }
            Err(_) => Ok(()),
        }
    }

    fn keep_quotas_enforced(&self) -> Result<bool> {
        match &self.storage {
            Ok(st) => st
                .keep_quotas_enforced()
                .map_err(|e| rt_err("checking the quota accounting", e)),
            Err(_) => Ok(false),
        }
    }

    fn reconcile_network(&self, owned: std::ops::Range<u32>, known_slots: &[u32]) -> Result<()> {
        match &self.network {
            Ok(net) => net
                .reconcile(owned, known_slots)
                .map_err(|e| rt_err("network reconcile", e)),
            Err(_) => Ok(()),
        }
    }

    fn limit_hit(&self, id: &str, _sandbox_dir: &Path) -> Option<DeathReason> {
        if Cgroup::handle(id)
            .ok()
            .and_then(|c| c.stats().ok())
            .is_some_and(|s| s.oom_kills > 0)
        {
            return Some(DeathReason::Oom);
        }
        // Full (within 1 MiB of the limit) writable layer.
        let usage = self
            .storage
            .as_ref()
            .ok()?
            .usage(&SandboxId::parse(id).ok()?)
            .ok()?;
        (usage.limit_bytes > 0 && usage.used_bytes + (1 << 20) >= usage.limit_bytes)
            .then_some(DeathReason::DiskFull)
    }

    fn set_limits(&self, id: &str, memory_mb: u64, cpus: u32, pids: u32) -> Result<()> {
        let limits = Limits {
            memory_bytes: memory_mb << 20,
            cpu_millis: cpus.saturating_mul(1000),
            pids,
        };
        let cg = Cgroup::handle(id).map_err(|e| rt_err("cgroup", e))?;
        if !cg.exists() {
            return Err(Error::SandboxNotFound(id.into()));
        }
        Cgroup::create(id, &limits)
            .map(drop)
            .map_err(|e| rt_err("set limits", e))
    }

    fn set_cpu_nice(&self, id: &str, nice: i32) {
        if let Err(e) = Cgroup::handle(id).and_then(|cg| cg.set_cpu_nice(nice)) {
            tracing::debug!(sandbox = %id, "cannot set the CPU weight for nice {nice}: {e}");
        }
    }

    fn memory_usage(&self, id: &str) -> Option<u64> {
        Cgroup::handle(id).ok()?.memory_bytes().ok()
    }

    fn init_pidfd(&self, id: &str) -> Option<std::sync::Arc<std::os::fd::OwnedFd>> {
        self.handles().get(id).map(Sandbox::shared_pidfd)
    }

    fn stats(&self, id: &str) -> Option<crate::runtime::SandboxStats> {
        let c = Cgroup::handle(id).ok()?;
        if !c.exists() {
            return None;
        }
        let s = c.stats().ok()?;
        let disk = (self.storage.as_ref().ok())
            .zip(SandboxId::parse(id).ok())
            .and_then(|(st, id)| st.usage(&id).ok());
        Some(crate::runtime::SandboxStats {
            memory_bytes: s.memory_bytes,
            oom_kills: s.oom_kills,
            cpu_usage_ns: s.cpu_usage_ns,
            pids: s.pids,
            pids_limit_hits: s.pids_limit_hits,
            disk_used_bytes: disk.map(|d| d.used_bytes),
            disk_limit_bytes: disk.map(|d| d.limit_bytes),
        })
    }

    fn max_slots(&self) -> u32 {
        match &self.network {
            Ok(net) => net.max_slots(),
            Err(_) => 32768,
        }
    }

    fn stop(&self, id: &str, slot: u32) -> Result<()> {
        self.release(id, slot)
    }

    fn checkpoint_support(&self) -> std::result::Result<(), String> {
        self.criu.as_ref().map(drop).map_err(Clone::clone)?;
        self.storage
            .as_ref()
            .map(drop)
            .map_err(|e| format!("no quota filesystem: {e}"))
    }

    fn checkpoint(
        &self,
        c: &crate::runtime::CheckpointSpec<'_>,
    ) -> Result<crate::runtime::CheckpointInfo> {
        let criu = self.criu()?;
        let spec = sandbox_spec(c.start);
        let id = &c.start.id;
        let storage = match &c.snapshot {
            Some(_) => Some(self.storage()?),
            None => None,
        };
        let mut snap = || -> cubicle_checkpoint::Result<()> {
            if let (Some(name), Some(st)) = (&c.snapshot, storage) {
                st.snapshot_sandbox_dir(id, name)?;
            }
            Ok(())
        };
        let what = if c.leave_running {
            "snapshot of sandbox"
        } else {
            "pausing sandbox"
        };
        if !c.memory {
            // Disk only: one frozen instant for the copy, no checkpoint.
            let t0 = std::time::Instant::now();
            let name = c.snapshot.as_deref().ok_or_else(|| {
                Error::InvalidRequest("a checkpoint without memory needs a snapshot name".into())
            })?;
            let st = self.storage()?;
            let cg = Cgroup::handle(id).map_err(|e| rt_err("cgroup", e))?;
            cg.freeze(std::time::Duration::from_secs(5))
                .map_err(|e| rt_err(&format!("freeze {id}"), e))?;
            let t_frozen = std::time::Instant::now();
            let res = st.snapshot_sandbox_dir(id, name);
            let thawed = cg.thaw();
            res.map_err(|e| rt_err(&format!("{what} {id}"), e))?;
            thawed.map_err(|e| rt_err(&format!("thaw {id}"), e))?;
            return Ok(crate::runtime::CheckpointInfo {
                frozen: t_frozen.elapsed(),
                total: t0.elapsed(),
                bytes: 0,
                phases: Vec::new(),
            });
        }
        let t0 = std::time::Instant::now();
        let report = cubicle_checkpoint::dump(
            criu,
            cubicle_checkpoint::DumpRequest {
                spec: &spec,
                init_pid: c.pid,
                dir: &c.dir,
                leave_running: c.leave_running,
                while_frozen: Some(&mut snap),
            },
        )
        .map_err(|e| ck_err(format!("{what} {id}"), e))?;
        let mut phases = report.phases;
        if !c.leave_running {
            self.release(id, c.start.slot)?;
            // Killing the dumped tree's leftovers, removing the cgroup and the veth.
            phases.push(("released".to_string(), t0.elapsed()));
        }
        Ok(crate::runtime::CheckpointInfo {
            frozen: report.frozen,
            total: report.total,
            bytes: report.bytes,
            phases,
        })
    }

    fn restore(&self, s: &StartSpec, checkpoint_dir: &Path) -> Result<Started> {
        let criu = self.criu()?;
        let spec = sandbox_spec(s);
        let net = if s.internet {
            Some(self.network()?)
        } else {
            None
        };
        // PID 1's output goes to its FIFO again, drained by the node (as after a spawn).
        let pipe = s.sandbox_dir.join(INIT_PIPE);
        let (log_reader, log) =
            cubicle_runtime::create_init_log(&pipe).map_err(|e| Error::io("mkfifo", &pipe, e))?;
        let mut attached = None;
        let mut on_ns = |pid: i32| -> cubicle_checkpoint::Result<()> {
            let ns = Netns::from_pid(pid)?;
            cubicle_runtime::network::loopback_up(&ns)?;
            if let Some(net) = net {
                attached = Some(net.attach(&ns, s.slot)?);
            }
            Ok(())
        };
        let restored = cubicle_checkpoint::restore(
            criu,
            cubicle_checkpoint::RestoreRequest {
                spec: &spec,
                dir: checkpoint_dir,
                stdio: Some(log),
                on_namespaces: &mut on_ns,
            },
        );
        let restored = match restored {
            Ok(r) => r,
            Err(e) => {
                if let Ok(cg) = Cgroup::handle(&s.id) {
                    let _ = cg.kill_all();
                    let _ = cg.remove();
                }
                if let Some(net) = net {
                    let _ = net.detach(s.slot);
                }
                return Err(ck_err(format!("restoring sandbox {}", s.id), e));
            }
        };
        let sb = Sandbox::adopt(&s.id, &s.sandbox_dir).map_err(|e| rt_err("adopt restored", e))?;
        self.logs.add(
            &s.id,
            log_reader,
            s.sandbox_dir.join(crate::init_log::INIT_LOG),
        );
        if attached.is_some()
            && let Err(e) = self.apply_policy(&s.id, s.slot, &s.network)
        {
            let _ = sb.destroy();
            let _ = self.detach_network(s.slot, false);
            return Err(e);
        }
        if sb.pid() != restored.pid {
            tracing::warn!(sandbox = %s.id, criu = restored.pid, found = sb.pid(), "restored init pid differs");
        }
        let pid = sb.pid();
        self.handles().insert(s.id.to_string(), sb);
        Ok(Started {
            pid,
            state: started_state(&restored.timings, attached.as_ref()),
        })
    }

    fn clone_snapshot(&self, snapshot: &str, id: &str, dir: &Path, disk_mb: u64) -> Result<()> {
        let st = self.storage()?;
        let id = SandboxId::parse(id).map_err(|e| rt_err("sandbox directory", e))?;
        let made = st
            .clone_snapshot(snapshot, &id, disk_mb << 20)
            .map_err(|e| rt_err(&format!("copy of snapshot {snapshot}"), e))?;
        if made != dir && std::fs::canonicalize(dir).ok().as_deref() != Some(made.as_path()) {
            let _ = st.remove_sandbox_dir(&id);
            return Err(Error::Runtime(format!(
                "storage made {} but the node expects {}",
                made.display(),
                dir.display()
            )));
        }
        Ok(())
    }

    fn seal_snapshot(&self, id: &str, snapshot: &str) -> Result<()> {
        let st = self.storage()?;
        let id = SandboxId::parse(id).map_err(|e| rt_err("sandbox directory", e))?;
        st.snapshot_sandbox_dir(&id, snapshot)
            .map(drop)
            .map_err(|e| rt_err(&format!("snapshot {snapshot} of {id}"), e))
    }

    fn snapshot_dir(&self, snapshot: &str) -> Result<std::path::PathBuf> {
        Ok(self.storage()?.root().join(snapshot))
    }

    fn remove_snapshot(&self, snapshot: &str) -> Result<()> {
        self.storage()?
            .remove_snapshot(snapshot)
            .map_err(|e| rt_err(&format!("removing snapshot {snapshot}"), e))
    }

    fn snapshots(&self) -> Result<Vec<String>> {
        match &self.storage {
            Ok(st) => st.snapshots().map_err(|e| rt_err("listing snapshots", e)),
            Err(_) => Ok(Vec::new()),
        }
    }

    fn volume_dir(&self, id: &str) -> Result<std::path::PathBuf> {
        self.storage()?
            .volume_dir(id)
            .map_err(|e| rt_err("volume", e))
    }

    fn create_volume(&self, id: &str, size_mb: u64, uid: u32, gid: u32, mode: u32) -> Result<()> {
        self.storage()?
            .create_volume_dir(id, size_mb << 20, uid, gid, mode)
            .map(drop)
            .map_err(|e| rt_err(&format!("creating volume {id}"), e))
    }

    fn remove_volume(&self, id: &str) -> Result<()> {
        self.storage()?
            .remove_volume_dir(id)
            .map_err(|e| rt_err(&format!("deleting volume {id}"), e))
    }

    fn volume_usage(&self, id: &str) -> Result<(u64, u64)> {
        self.storage()?
            .volume_usage(id)
            .map(|u| (u.used_bytes, u.limit_bytes))
            .map_err(|e| rt_err(&format!("usage of volume {id}"), e))
    }

    fn reconcile_volumes(&self) -> Result<Vec<String>> {
        let Ok(st) = &self.storage else {
            return Ok(Vec::new());
        };
        st.reconcile_volumes()
            .and_then(|()| st.volume_ids())
            .map_err(|e| rt_err("volume reconcile", e))
    }

    fn attach_root(&self, s: &StartSpec) -> Result<()> {
        let spec = sandbox_spec(s);
        // The handle's pid and pidfd, not the handle: the lock is not held for the attach.
        let (pid, pidfd) = {
            let handles = self.handles();
            let sb = handles
                .get(s.id.as_str())
                .ok_or_else(|| Error::SandboxNotFound(s.id.to_string()))?;
            (sb.pid(), sb.shared_pidfd())
        };
        use std::os::fd::AsFd;
        let timings = cubicle_runtime::attach_root(pidfd.as_fd(), pid, &spec)
            .map_err(|e| rt_err("attach a template's root", e))?;
        self.writeback.note();
        tracing::debug!(
            sandbox = %s.id,
            steps = ?timings.iter().map(|(n, d)| format!("{n}={}", d.as_micros())).collect::<Vec<_>>(),
            "runtime attach_root"
        );
        Ok(())
    }

    fn attach_volumes(
        &self,
        id: &str,
        pidfd: std::os::fd::BorrowedFd<'_>,
        pid: i32,
        uid_base: u32,
        volumes: &[(std::path::PathBuf, std::path::PathBuf, bool)],
    ) -> Result<()> {
        let binds: Vec<cubicle_runtime::BindMount> = volumes
            .iter()
            .map(|(source, target, readonly)| cubicle_runtime::BindMount {
                source: source.clone(),
                target: target.clone(),
                readonly: *readonly,
                idmapped: true,
            })
            .collect();
        cubicle_runtime::attach_binds(pidfd, pid, uid_base, &binds)
            .map_err(|e| rt_err(&format!("mounting volumes in {id}"), e))
    }

    fn set_network(&self, id: &str, slot: u32, pid: i32, policy: &NetworkPolicy) -> Result<bool> {
        let net = match &self.network {
            Ok(net) => net,
            // Without networking only "no network at all" can be honoured.
            Err(_) if !policy.needs_network() => return Ok(false),
            Err(e) => {
                return Err(Error::Runtime(format!(
                    "sandbox networking unavailable: {e}"
                )));
            }
        };
        let attached = net
            .is_attached(slot)
            .map_err(|e| rt_err("network state", e))?;
        if !attached {
            if !policy.needs_network() {
                return Ok(false);
            }
            // The namespace file by pid (netlink takes only namespace files as a new
            // link's peer namespace: a pidfd there is EINVAL), then, when this process
            // holds the sandbox's pidfd, proof that the pid still named the sandbox when
            // it was opened: a pid is only reused after its process exited.
            let pidfd = self
                .handles()
                .get(id)
                .and_then(|sb| sb.pidfd().try_clone().ok());
            let ns = Netns::from_pid(pid).map_err(|e| rt_err("netns", e))?;
            if pidfd.is_some_and(|fd| cubicle_syscalls::pidfd::exited(&fd)) {
                return Err(Error::Runtime(format!(
                    "sandbox {id} exited while its network was being attached"
                )));
            }
            net.attach(&ns, slot)
                .map_err(|e| rt_err("network attach", e))?;
        }
        self.apply_policy(id, slot, policy)?;
        Ok(true)
    }

    fn cut_refused(&self, id: &str, slot: u32, policy: &NetworkPolicy) -> Result<()> {
        let Ok(net) = &self.network else {
            return Ok(());
        };
        // Its namespace, for its own ends of what is cut (none: the entries only).
        let ns = || {
            let handles = self.handles();
            let sb = handles.get(id)?;
            Netns::of_process(sb.pid(), sb.pidfd()).ok()
        };
        net.forget_refused(slot, &policy.kernel(), ns)
            .map(drop)
            .map_err(|e| rt_err("cutting the connections its policy refuses", e))
    }

    fn egress_relayed(&self) -> Option<usize> {
        self.egress.as_ref().map(Egress::relayed)
    }

    fn network_log(&self, id: &str, after: u64, limit: usize) -> Vec<NetEvent> {
        match &self.egress {
            Some(eg) => eg.audit().read(id, after, limit),
            None => Vec::new(),
        }
    }

    fn grown_logs(
        &self,
        since: Option<crate::init_log::LogMark>,
    ) -> Option<crate::init_log::GrownLogs> {
        Some(self.logs.grown_since(since))
    }

    fn forget_network_log(&self, id: &str) {
        if let Some(eg) = &self.egress {
            eg.audit().remove(id);
        }
    }

    fn egress(&self) -> Option<Egress> {
        self.egress.clone()
    }

    fn close(&self) {
        if let Some(eg) = &self.egress {
            eg.shutdown();
        }
    }

    fn release_storage(&self) {
        if let Ok(st) = &self.storage {
            if let Err(e) = st.drop_recycled() {
                tracing::warn!("dropping the recycled sandbox directories: {e}");
            }
            match st.release() {
                Ok(true) => {
                    tracing::info!(path = %st.root().display(), "unmounted the sandboxes' quota filesystem")
                }
                Ok(false) => {}
                Err(e) => tracing::info!("the sandboxes' quota filesystem stays mounted: {e}"),
            }
        }
    }
}
