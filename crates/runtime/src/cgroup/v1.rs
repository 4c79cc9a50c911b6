//! cgroup v1 backend: one directory per controller (memory, cpu, cpuacct, pids, freezer).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{
    CPU_PERIOD_US, Cgroup, CgroupStats, PARENT, cpu_quota_us, cpu_shares, keyed_value, read_file,
    read_u64, write_file,
};
use crate::error::{Error, Result, io_ctx};
use crate::spec::Limits;

/// Mount points of the v1 controllers the runtime uses.
#[derive(Clone, Debug, Default)]
pub(crate) struct Mounts {
    pub memory: PathBuf,
    pub cpu: PathBuf,
    pub cpuacct: PathBuf,
    pub pids: PathBuf,
    pub freezer: PathBuf,
    /// Hierarchies without our controllers that a service manager tracks processes by:
    /// `name=systemd` and the controller-less unified (v2) mount of a hybrid host.
    /// Sandboxes join the shared `cubicle` cgroup there, so they are outside the cgroup
    /// of the service that started them (a systemd stop or restart of `cubicle serve`
    /// kills what is in its cgroup, and must not reach a sandbox). One shared cgroup, not
    /// one per sandbox: they hold no limits, and every v1 mount a sandbox makes walks
    /// every cgroup of the unified hierarchy (`cgroup_lock_and_drain_offline` in
    /// `cgroup1_get_tree`), four mounts per sandbox, 6.7 % of all CPU at 6,000 sandboxes.
    /// Older builds made `cubicle/<id>` there: removal and reconciliation still look.
    pub tracking: Vec<PathBuf>,
    /// The unified (v2) hierarchy among [`tracking`](Self::tracking), if the host has
    /// one: a helper can be cloned straight into its `cubicle` (`CLONE_INTO_CGROUP`).
    pub unified: Option<PathBuf>,
}

impl Mounts {
    /// Records `mount_point` for controller option `opt` (from the super options).
    pub(crate) fn set(&mut self, opt: &str, mount_point: &Path) {
        let slot = match opt {
            "memory" => &mut self.memory,
            "cpu" => &mut self.cpu,
            "cpuacct" => &mut self.cpuacct,
            "pids" => &mut self.pids,
            "freezer" => &mut self.freezer,
            _ => return,
        };
        if slot.as_os_str().is_empty() {
            *slot = mount_point.to_path_buf();
        }
    }

    /// Ok when every controller was found; else the names of the missing ones.
    pub(crate) fn complete(self) -> std::result::Result<Mounts, String> {
        let missing: Vec<&str> = [
            ("memory", &self.memory),
            ("cpu", &self.cpu),
            ("cpuacct", &self.cpuacct),
            ("pids", &self.pids),
            ("freezer", &self.freezer),
        ]
        .iter()
        .filter(|(_, p)| p.as_os_str().is_empty())
        .map(|(n, _)| *n)
        .collect();
        if missing.is_empty() {
            Ok(self)
        } else {
            Err(missing.join(", "))
        }
    }

    /// The controllers of each distinct hierarchy, joined with ',' (`cpu,cpuacct` when
    /// co-mounted), in the order of [`all`](Self::all).
    pub(crate) fn hierarchies(&self) -> Vec<String> {
        let named = [
            ("memory", &self.memory),
            ("cpu", &self.cpu),
            ("cpuacct", &self.cpuacct),
            ("pids", &self.pids),
            ("freezer", &self.freezer),
        ];
        self.all()
            .iter()
            .map(|mp| {
                named
                    .iter()
                    .filter(|(_, p)| *p == mp)
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect()
    }

    /// Records a process-tracking hierarchy (see [`Mounts::tracking`]).
    pub(crate) fn track(&mut self, mount_point: &Path) {
        if !self.tracking.iter().any(|p| p == mount_point) {
            self.tracking.push(mount_point.to_path_buf());
        }
    }

    /// Every hierarchy a sandbox joins: the controllers' and the tracking ones (where
    /// older builds made `cubicle/<id>` too).
    pub(crate) fn joined(&self) -> Vec<PathBuf> {
        let mut v = self.all();
        v.extend(self.tracking.iter().cloned());
        v
    }

    /// Distinct mount points (co-mounted controllers appear once).
    pub(crate) fn all(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = Vec::new();
        for p in [
            &self.memory,
            &self.cpu,
            &self.cpuacct,
            &self.pids,
            &self.freezer,
        ] {
            if !v.contains(p) {
                v.push(p.clone());
            }
        }
        v
    }
}

fn mkdir(path: &Path) -> Result<()> {
    match std::fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_ctx(|| format!("mkdir {}", path.display()))(e)),
    }
}

pub(crate) fn create(m: &Mounts, id: &str, limits: &Limits) -> Result<()> {
    for root in m.all() {
        mkdir(&root.join(PARENT))?;
        mkdir(&root.join(PARENT).join(id))?;
    }
    for root in &m.tracking {
        mkdir(&root.join(PARENT))?;
    }
    let mem = m.memory.join(PARENT).join(id);
    let memsw = mem.join("memory.memsw.limit_in_bytes");
    // memsw must stay >= limit at every step: lift it first (a reused cgroup may have a
    // lower one), then set the limit, then pin memsw to it.
    if memsw.exists() {
        write_file(&memsw, "-1")?;
    }
    write_file(
        &mem.join("memory.limit_in_bytes"),
        &limits.memory_bytes.to_string(),
    )?;
    // No swap: memory+swap limit equal to the memory limit (when swap accounting exists).
    if memsw.exists() {
        write_file(&memsw, &limits.memory_bytes.to_string())?;
    } else {
        write_file(&mem.join("memory.swappiness"), "0")?;
    }
    let cpu = m.cpu.join(PARENT).join(id);
    // Each write of the period or the quota walks every CPU cgroup of the host
    // (`tg_set_cfs_bandwidth` checks the whole tree's schedulability): 5 % of all CPU at
    // 2,000-3,000 sandboxes. A new cgroup already has the kernel's default period, ours,
    // so it is written only where it differs (a reused cgroup someone changed).
    let period = cpu.join("cpu.cfs_period_us");
    if read_u64(&period).ok() != Some(CPU_PERIOD_US) {
        write_file(&period, &CPU_PERIOD_US.to_string())?;
    }
    write_file(
        &cpu.join("cpu.cfs_quota_us"),
        &cpu_quota_us(limits.cpu_millis).to_string(),
    )?;
    write_file(
        &cpu.join("cpu.shares"),
        &cpu_shares(limits.cpu_millis).to_string(),
    )?;
    let pids = m.pids.join(PARENT).join(id);
    write_file(&pids.join("pids.max"), &limits.pids.to_string())?;
    Ok(())
}

/// The memory hierarchy's usage counter of cgroup `id`.
pub(crate) fn memory_bytes(m: &Mounts, id: &str) -> Result<u64> {
    read_u64(&m.memory.join(PARENT).join(id).join("memory.usage_in_bytes"))
}

pub(crate) fn stats(m: &Mounts, id: &str) -> Result<CgroupStats> {
    let mem = m.memory.join(PARENT).join(id);
    let oom = read_file(&mem.join("memory.oom_control"))?;
    let pids_dir = m.pids.join(PARENT).join(id);
    let pids_events = read_file(&pids_dir.join("pids.events")).unwrap_or_default();
    Ok(CgroupStats {
        memory_bytes: memory_bytes(m, id)?,
        memory_peak_bytes: read_u64(&mem.join("memory.max_usage_in_bytes")).ok(),
        cpu_usage_ns: read_u64(&m.cpuacct.join(PARENT).join(id).join("cpuacct.usage"))?,
        oom_kills: keyed_value(&oom, "oom_kill").unwrap_or(0),
        pids: read_u64(&pids_dir.join("pids.current"))?,
        pids_limit_hits: keyed_value(&pids_events, "max").unwrap_or(0),
    })
}

/// Freeze, SIGKILL every member, thaw; repeat until nothing is left (or the deadline).
/// Frozen tasks cannot fork, so nothing escapes between reading cgroup.procs and killing.
pub(crate) fn kill_all(m: &Mounts, cg: &Cgroup, deadline: Instant) -> Result<()> {
    let state = m.freezer.join(PARENT).join(cg.id()).join("freezer.state");
    if !state.exists() {
        // Partially created cgroup (crash mid-create): no freezer, kill what is there.
        loop {
            let procs = cg.procs()?;
            if procs.is_empty() {
                return Ok(());
            }
            for pid in &procs {
                // SAFETY: kill with integer arguments.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
            if Instant::now() > deadline {
                return Err(Error::Cgroup(format!(
                    "cannot empty cgroup {PARENT}/{}",
                    cg.id()
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    loop {
        write_file(&state, "FROZEN")?;
        // Wait (briefly) until the freeze completed; killing a FREEZING cgroup also works,
        // so a timeout here is not fatal.
        let freeze_deadline = Instant::now() + Duration::from_millis(200);
        while read_file(&state)? != "FROZEN" && Instant::now() < freeze_deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        let procs = cg.procs()?;
        for pid in &procs {
            // SAFETY: kill with integer arguments; ESRCH (already gone) is fine.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
        write_file(&state, "THAWED")?;
        if procs.is_empty() || cg.procs()?.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Cgroup(format!(
                "cannot empty cgroup {PARENT}/{}",
                cg.id()
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
