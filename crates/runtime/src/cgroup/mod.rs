//! Per-sandbox cgroups: `cubicle/<id>`, with limits, stats, kill-all and removal.
//!
//! Two backends, chosen at runtime from `/proc/self/mountinfo`:
//! - **v2** (production): `/sys/fs/cgroup` is cgroup2; the sandbox cgroup is
//!   `/sys/fs/cgroup/cubicle/<id>` with memory, cpu and pids enabled in `cubicle/`.
//! - **v1** (this development machine, "hybrid"): one directory per controller,
//!   `<memory mount>/cubicle/<id>`, same for cpu, cpuacct, pids and freezer; in the
//!   hierarchies without controllers that systemd tracks services by (`name=systemd`,
//!   the unified mount) every sandbox joins the shared `cubicle` cgroup, so that it is
//!   outside the cgroup of the service that started it everywhere (on v2 it is by
//!   construction).
//!
//! The sandbox helper joins the cgroup *before* it clones the sandbox's init, so the init
//! and everything it starts are born in it (and the cgroup namespace is rooted there).

mod v1;
mod v2;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::SandboxId;
use crate::error::{Error, Result, io_ctx};
use crate::spec::Limits;

/// Parent cgroup of every sandbox cgroup, at the root of each hierarchy.
pub const PARENT: &str = "cubicle";

/// cgroup period used for CPU quotas (100 ms).
pub const CPU_PERIOD_US: u64 = 100_000;

/// Which cgroup version the host runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// Usage counters of one sandbox cgroup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupStats {
    /// Current memory usage in bytes (page cache included).
    pub memory_bytes: u64,
    /// Peak memory usage in bytes, when the kernel reports it.
    pub memory_peak_bytes: Option<u64>,
    /// Total CPU time consumed, in nanoseconds.
    pub cpu_usage_ns: u64,
    /// Number of processes the OOM killer killed in this cgroup.
    pub oom_kills: u64,
    /// Current number of tasks.
    pub pids: u64,
    /// Times a fork was refused because of the pids limit.
    pub pids_limit_hits: u64,
}

/// The cgroup filesystems a sandbox mounts (read-only) at its `/sys/fs/cgroup`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum InnerMounts {
    V2,
    /// One entry per v1 hierarchy: its controllers joined with ',' (e.g. `cpu,cpuacct`).
    V1(Vec<String>),
}

/// The cgroup layout of this host.
#[derive(Clone, Debug)]
pub(crate) enum Layout {
    /// Mount points of the v1 controllers we use (deduplicated when co-mounted).
    V1(v1::Mounts),
    /// Mount point of the unified hierarchy.
    V2(PathBuf),
}

impl Layout {
    /// Detects the layout from `/proc/self/mountinfo` (once per process: a host does not
    /// switch cgroup versions while running).
    pub(crate) fn detect() -> Result<Layout> {
        static LAYOUT: std::sync::OnceLock<Layout> = std::sync::OnceLock::new();
        if let Some(l) = LAYOUT.get() {
            return Ok(l.clone());
        }
        let info = fs::read_to_string("/proc/self/mountinfo")
            .map_err(io_ctx(|| "read /proc/self/mountinfo".into()))?;
        let layout = parse_layout(&info)?;
        Ok(LAYOUT.get_or_init(|| layout).clone())
    }
}

fn parse_layout(mountinfo: &str) -> Result<Layout> {
    let mut v1 = v1::Mounts::default();
    for m in cubicle_syscalls::mountinfo::parse(mountinfo) {
        match m.fstype.as_str() {
            "cgroup2" if m.mount_point == Path::new("/sys/fs/cgroup") => {
                return Ok(Layout::V2(m.mount_point));
            }
            // The unified hierarchy of a hybrid host (no controllers: tracking only).
            "cgroup2" => {
                v1.track(&m.mount_point);
                v1.unified.get_or_insert(m.mount_point.clone());
            }
            "cgroup" => {
                let opts = m.super_options.split(',');
                if opts.clone().any(|o| o == "name=systemd") {
                    v1.track(&m.mount_point);
                }
                for opt in opts {
                    v1.set(opt, &m.mount_point);
                }
            }
            _ => {}
        }
    }
    v1.complete().map(Layout::V1).map_err(|missing| {
        Error::Cgroup(format!(
            "no cgroup2 at /sys/fs/cgroup and v1 controller(s) {missing} not mounted"
        ))
    })
}

/// Which cgroup version this host uses.
pub fn detect_version() -> Result<CgroupVersion> {
    Ok(match Layout::detect()? {
        Layout::V1(_) => CgroupVersion::V1,
        Layout::V2(_) => CgroupVersion::V2,
    })
}

/// The cgroup of one sandbox.
#[derive(Clone, Debug)]
pub struct Cgroup {
    id: String,
    layout: Layout,
}

impl Cgroup {
    /// Creates `cubicle/<id>` (in every hierarchy on v1) and applies `limits`.
    /// An existing cgroup of that id is reused and its limits rewritten.
    pub fn create(id: &str, limits: &Limits) -> Result<Cgroup> {
        let cg = Cgroup::handle(id)?;
        let res = match &cg.layout {
            Layout::V1(m) => v1::create(m, id, limits),
            Layout::V2(root) => v2::create(root, id, limits),
        };
        if let Err(e) = res {
            let _ = cg.remove_dirs_once();
            return Err(e);
        }
        Ok(cg)
    }

    /// Scales the cgroup's CPU weight for `nice`, as the kernel scales a task's weight
    /// by its nice value: the weight the CPU limit gives at 0, about 1/68 of it at 19.
    ///
    /// A task's nice value orders it only against tasks of its own cgroup: between
    /// cgroups the scheduler weighs the groups. A pooled sandbox made at nice 19 in a
    /// cgroup of full weight competed with claims as an equal (in bursts of 50 claims,
    /// the refills' helpers took 14 % of the two cores); this gives its cgroup the
    /// nice too. The limit is read back from the cgroup (its CPU quota).
    pub fn set_cpu_nice(&self, nice: i32) -> Result<()> {
        match &self.layout {
            Layout::V1(m) => {
                let dir = m.cpu.join(PARENT).join(&self.id);
                let quota = read_file(&dir.join("cpu.cfs_quota_us"))?;
                let millis = cpu_millis_of(quota.trim().parse::<i64>().ok());
                write_file(
                    &dir.join("cpu.shares"),
                    &at_nice(cpu_shares(millis), nice, SHARES).to_string(),
                )
            }
            Layout::V2(root) => {
                let dir = root.join(PARENT).join(&self.id);
                let max = read_file(&dir.join("cpu.max"))?;
                let quota = max.split_whitespace().next().and_then(|q| q.parse().ok());
                write_file(
                    &dir.join("cpu.weight"),
                    &at_nice(cpu_weight(cpu_millis_of(quota)), nice, WEIGHT).to_string(),
                )
            }
        }
    }

    /// A handle to `cubicle/<id>` whether or not it exists.
    pub fn handle(id: &str) -> Result<Cgroup> {
        if !SandboxId::is_valid(id) {
            return Err(Error::InvalidSpec(format!("sandbox id {id:?}")));
        }
        Ok(Cgroup {
            id: id.to_string(),
            layout: Layout::detect()?,
        })
    }

    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Cgroup version of this handle.
    pub fn version(&self) -> CgroupVersion {
        match self.layout {
            Layout::V1(_) => CgroupVersion::V1,
            Layout::V2(_) => CgroupVersion::V2,
        }
    }

    /// What the sandbox mounts at its /sys/fs/cgroup.
    pub(crate) fn inner_mounts(&self) -> InnerMounts {
        match &self.layout {
            Layout::V2(_) => InnerMounts::V2,
            Layout::V1(m) => InnerMounts::V1(m.hierarchies()),
        }
    }

    /// Every directory of this cgroup (one on v2, one per controller hierarchy on v1).
    pub fn dirs(&self) -> Vec<PathBuf> {
        match &self.layout {
            Layout::V1(m) => m
                .all()
                .iter()
                .map(|p| p.join(PARENT).join(&self.id))
                .collect(),
            Layout::V2(root) => vec![root.join(PARENT).join(&self.id)],
        }
    }

    /// The shared cgroups a sandbox's processes join besides [`dirs`](Self::dirs): on a
    /// hybrid v1 host, `cubicle` in each tracking hierarchy (see `v1::Mounts::tracking`).
    fn shared_dirs(&self) -> Vec<PathBuf> {
        match &self.layout {
            Layout::V1(m) => m.tracking.iter().map(|p| p.join(PARENT)).collect(),
            Layout::V2(_) => Vec::new(),
        }
    }

    /// `cubicle/<id>` in the tracking hierarchies, where builds before the shared
    /// cgroup put a sandbox (one adopted from such a build is removed from there too).
    fn legacy_dirs(&self) -> Vec<PathBuf> {
        self.shared_dirs()
            .iter()
            .map(|p| p.join(&self.id))
            .collect()
    }

    /// Whether any directory of this cgroup exists.
    pub fn exists(&self) -> bool {
        self.dirs()
            .iter()
            .chain(self.legacy_dirs().iter())
            .any(|d| d.is_dir())
    }

    /// Moves process `pid` (0 = the caller) into the cgroup, in every hierarchy.
    pub fn add_process(&self, pid: i32) -> Result<()> {
        for d in self.dirs().into_iter().chain(self.shared_dirs()) {
            let f = d.join("cgroup.procs");
            fs::write(&f, pid.to_string()).map_err(io_ctx(|| format!("write {}", f.display())))?;
        }
        Ok(())
    }

    /// The v2 cgroup a sandbox's helper can be cloned straight into
    /// (`clone3(CLONE_INTO_CGROUP)`): its own on a v2 host, the shared `cubicle` of the
    /// unified tracking hierarchy on a hybrid one; none on a v1 host without it.
    pub(crate) fn clone_target(&self) -> Option<PathBuf> {
        match &self.layout {
            Layout::V2(root) => Some(root.join(PARENT).join(&self.id)),
            Layout::V1(m) => m.unified.as_ref().map(|u| u.join(PARENT)),
        }
    }

    /// Moves the calling process, which must be single-threaded (a sandbox's helper) and
    /// cloned into the [`clone_target`](Self::clone_target), into the cgroup in every
    /// other hierarchy.
    ///
    /// Moving a whole process (`cgroup.procs`) write-locks the kernel's global
    /// thread-group semaphore, and that waits for an RCU grace period: 5–20 ms while
    /// other sandboxes are made and removed (round 28 of docs/bench.md). Moving the
    /// calling *thread* (`0` into a v1 `tasks` file) skips that lock, and for a
    /// single-threaded process it is the same move; v2 has no such file for a domain
    /// cgroup, where the clone makes the move instead.
    pub(crate) fn join_single_threaded(&self) -> Result<()> {
        let Layout::V1(m) = &self.layout else {
            return Ok(());
        };
        let shared = m.tracking.iter().filter(|t| m.unified.as_ref() != Some(*t));
        for d in self
            .dirs()
            .into_iter()
            .chain(shared.map(|t| t.join(PARENT)))
        {
            let f = d.join("tasks");
            fs::write(&f, "0").map_err(io_ctx(|| format!("write {}", f.display())))?;
        }
        Ok(())
    }

    /// Pids (host view) of every process in the cgroup (in any hierarchy on v1: after a
    /// crash mid-create, a process may sit in some hierarchies only).
    pub fn procs(&self) -> Result<Vec<i32>> {
        let mut pids: Vec<i32> = Vec::new();
        for dir in self.dirs().into_iter().chain(self.legacy_dirs()) {
            for p in pids_in(&dir)? {
                if !pids.contains(&p) {
                    pids.push(p);
                }
            }
        }
        Ok(pids)
    }

    /// Reads the usage counters.
    pub fn stats(&self) -> Result<CgroupStats> {
        match &self.layout {
            Layout::V1(m) => v1::stats(m, &self.id),
            Layout::V2(root) => v2::stats(&root.join(PARENT).join(&self.id)),
        }
    }

    /// [`CgroupStats::memory_bytes`] alone: one file read, not [`Cgroup::stats`]'s six
    /// (the pool's memory estimate reads it for every pooled sandbox; each read walks the
    /// cgroup filesystem under the lock that cgroup creations and removals take).
    pub fn memory_bytes(&self) -> Result<u64> {
        match &self.layout {
            Layout::V1(m) => v1::memory_bytes(m, &self.id),
            Layout::V2(root) => v2::memory_bytes(&root.join(PARENT).join(&self.id)),
        }
    }

    /// The directory whose freezer state freezes the whole sandbox (v1: the freezer
    /// hierarchy's; v2: the cgroup's own), as CRIU's `freeze_cgroup` wants it.
    pub fn freezer_dir(&self) -> PathBuf {
        match &self.layout {
            Layout::V1(m) => m.freezer.join(PARENT).join(&self.id),
            Layout::V2(root) => root.join(PARENT).join(&self.id),
        }
    }

    /// Freezes every task of the sandbox and waits (up to `timeout`) until the kernel
    /// reports the whole cgroup frozen. On timeout the cgroup is thawed again.
    ///
    /// v1 is told again at every look while it says `FREEZING`: a task forked while the
    /// kernel walks the cgroup can escape that walk, and the cgroup then stays
    /// `FREEZING` for good (a shell running commands in a loop: 20 of 300 freezes stuck
    /// past 1 s when told once, none when told again). v2 has no such gap.
    pub fn freeze(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let dir = self.freezer_dir();
        let (file, set, frozen): (PathBuf, &str, fn(&str) -> bool) = match &self.layout {
            Layout::V1(_) => (dir.join("freezer.state"), "FROZEN", |s| s == "FROZEN"),
            Layout::V2(_) => (dir.join("cgroup.freeze"), "1", |_| false),
        };
        write_file(&file, set)?;
        loop {
            let done = match &self.layout {
                Layout::V1(_) => {
                    let done = frozen(read_file(&file)?.trim());
                    if !done {
                        write_file(&file, set)?;
                    }
                    done
                }
                Layout::V2(_) => {
                    keyed_value(&read_file(&dir.join("cgroup.events"))?, "frozen") == Some(1)
                }
            };
            if done {
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = self.thaw();
                return Err(Error::Cgroup(format!(
                    "cgroup {PARENT}/{} did not freeze within {timeout:?}",
                    self.id
                )));
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    /// Lets the tasks of a frozen sandbox run again.
    pub fn thaw(&self) -> Result<()> {
        let dir = self.freezer_dir();
        match &self.layout {
            Layout::V1(_) => write_file(&dir.join("freezer.state"), "THAWED"),
            Layout::V2(_) => write_file(&dir.join("cgroup.freeze"), "0"),
        }
    }

    /// The controllers a sandbox's cgroup spans, as CRIU names them (for its per-controller
    /// `cgroup_root`): v1 `memory`, `cpu`, `cpuacct`, `pids`, `freezer`; v2 none (the
    /// unified hierarchy has one root).
    pub fn controllers(&self) -> Vec<&'static str> {
        match &self.layout {
            Layout::V1(_) => vec!["memory", "cpu", "cpuacct", "pids", "freezer"],
            Layout::V2(_) => Vec::new(),
        }
    }

    /// A directory holding one mount per controller of [`controllers`](Self::controllers),
    /// named after it (`<dir>/memory`, …), as CRIU's `cgroup_yard` wants it — so that a
    /// restore need not mount every hierarchy itself. v1 with the usual layout
    /// (`/sys/fs/cgroup/<controller>`) only.
    pub fn criu_yard(&self) -> Option<PathBuf> {
        let Layout::V1(m) = &self.layout else {
            return None;
        };
        let named = [
            ("memory", &m.memory),
            ("cpu", &m.cpu),
            ("cpuacct", &m.cpuacct),
            ("pids", &m.pids),
            ("freezer", &m.freezer),
        ];
        let parent = m.memory.parent()?.to_path_buf();
        named
            .iter()
            .all(|(n, p)| p.as_path() == parent.join(n))
            .then_some(parent)
    }

    /// Kills every process in the cgroup with SIGKILL and waits (up to 5 s) until it is
    /// empty. v2: `cgroup.kill`; v1: freeze, kill each pid, thaw, repeat until empty.
    pub fn kill_all(&self) -> Result<()> {
        if !self.exists() {
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        match &self.layout {
            Layout::V1(m) => v1::kill_all(m, self, deadline)?,
            Layout::V2(root) => v2::kill_all(&root.join(PARENT).join(&self.id), self, deadline)?,
        }
        while Instant::now() < deadline {
            if self.procs()?.is_empty() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Err(Error::Cgroup(format!(
            "cgroup {PARENT}/{} still has processes {:?} 5 s after SIGKILL",
            self.id,
            self.procs()?
        )))
    }

    fn remove_dirs_once(&self) -> io::Result<bool> {
        let mut all_gone = true;
        for d in self.dirs().into_iter().chain(self.legacy_dirs()) {
            match fs::remove_dir(&d) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => all_gone = false,
                Err(e) => return Err(e),
            }
        }
        Ok(all_gone)
    }

    /// Removes the cgroup directories, retrying (up to 5 s) while exiting tasks still
    /// hold them. Call [`kill_all`](Self::kill_all) first.
    pub fn remove(&self) -> Result<()> {
        self.remove_within(Duration::from_secs(5))
    }

    /// [`remove`](Self::remove) with a custom retry budget.
    pub(crate) fn remove_within(&self, budget: Duration) -> Result<()> {
        let deadline = Instant::now() + budget;
        loop {
            let gone = self
                .remove_dirs_once()
                .map_err(io_ctx(|| format!("rmdir cgroup {PARENT}/{}", self.id)))?;
            if gone {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::Cgroup(format!(
                    "cgroup {PARENT}/{} still busy after {budget:?} (processes {:?})",
                    self.id,
                    self.procs().unwrap_or_default()
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Ids of every existing `cubicle/<id>` cgroup (in any hierarchy), for reconciliation.
pub fn list() -> Result<Vec<String>> {
    let parents: Vec<PathBuf> = match Layout::detect()? {
        Layout::V1(m) => m.joined().iter().map(|p| p.join(PARENT)).collect(),
        Layout::V2(root) => vec![root.join(PARENT)],
    };
    let mut ids = Vec::new();
    for p in parents {
        let rd = match fs::read_dir(&p) {
            Ok(rd) => rd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_ctx(|| format!("read_dir {}", p.display()))(e)),
        };
        for entry in rd.flatten() {
            if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                continue;
            }
            if let Some(name) = entry.file_name().to_str()
                && SandboxId::is_valid(name)
                && !ids.iter().any(|i| i == name)
            {
                ids.push(name.to_string());
            }
        }
    }
    ids.sort();
    Ok(ids)
}

/// Writes `value` to a cgroup control file, with the path in the error.
pub(crate) fn write_file(path: &Path, value: &str) -> Result<()> {
    fs::write(path, value).map_err(io_ctx(|| format!("write {value:?} to {}", path.display())))
}

/// Reads a cgroup control file as a trimmed string.
pub(crate) fn read_file(path: &Path) -> Result<String> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(io_ctx(|| format!("read {}", path.display())))
}

/// Pids listed in `dir/cgroup.procs` (none when the directory is gone).
fn pids_in(dir: &Path) -> Result<Vec<i32>> {
    let f = dir.join("cgroup.procs");
    match fs::read_to_string(&f) {
        Ok(s) => Ok(s.lines().filter_map(|l| l.trim().parse().ok()).collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(io_ctx(|| format!("read {}", f.display()))(e)),
    }
}

/// Reads a control file holding one integer (`max` counts as `u64::MAX`).
pub(crate) fn read_u64(path: &Path) -> Result<u64> {
    let s = read_file(path)?;
    if s == "max" {
        return Ok(u64::MAX);
    }
    s.parse()
        .map_err(|_| Error::Cgroup(format!("{}: unexpected content {s:?}", path.display())))
}

/// Value of `key` in a flat-keyed file (`key value` per line: memory.events,
/// memory.oom_control, cpu.stat, pids.events).
pub(crate) fn keyed_value(content: &str, key: &str) -> Option<u64> {
    content.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key))
            .then(|| it.next().and_then(|v| v.parse().ok()))
            .flatten()
    })
}

/// CPU weight for cgroup v1 `cpu.shares` (1024 per CPU).
pub(crate) fn cpu_shares(cpu_millis: u32) -> u64 {
    (u64::from(cpu_millis) * 1024 / 1000).clamp(SHARES.0, SHARES.1)
}

/// The range the kernel accepts for v1 `cpu.shares`.
const SHARES: (u64, u64) = (2, 262_144);
/// The range the kernel accepts for v2 `cpu.weight`.
const WEIGHT: (u64, u64) = (1, 10_000);

/// CPU weight for cgroup v2 `cpu.weight` (100 per CPU, the v2 default for one).
pub(crate) fn cpu_weight(cpu_millis: u32) -> u64 {
    (u64::from(cpu_millis) / 10).clamp(WEIGHT.0, WEIGHT.1)
}

/// The CPU limit in millicores that a CFS quota (µs per [`CPU_PERIOD_US`]) stands for;
/// none (`max`, -1) counts as one CPU.
fn cpu_millis_of(quota_us: Option<i64>) -> u32 {
    match quota_us {
        Some(q) if q > 0 => (q as u64 * 1000 / CPU_PERIOD_US).min(u64::from(u32::MAX)) as u32,
        _ => 1000,
    }
}

/// `weight` scaled by `nice` as the scheduler scales a task's (1.25× per step; its
/// table has 1024 at 0, 110 at 10, 15 at 19), within `range`.
fn at_nice(weight: u64, nice: i32, (lo, hi): (u64, u64)) -> u64 {
    let nice = nice.clamp(-20, 19);
    ((weight as f64) * 1.25f64.powi(-nice))
        .round()
        .clamp(lo as f64, hi as f64) as u64
}

/// CFS quota in microseconds per [`CPU_PERIOD_US`].
pub(crate) fn cpu_quota_us(cpu_millis: u32) -> u64 {
    (u64::from(cpu_millis) * CPU_PERIOD_US / 1000).max(1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
30 24 0:26 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
33 30 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:14 - cgroup cgroup rw,cpu,cpuacct
34 30 0:30 / /sys/fs/cgroup/memory rw,nosuid shared:15 - cgroup cgroup rw,memory
35 30 0:31 / /sys/fs/cgroup/pids rw,nosuid shared:16 - cgroup cgroup rw,pids
36 30 0:32 / /sys/fs/cgroup/freezer rw,nosuid shared:17 - cgroup cgroup rw,freezer
37 30 0:33 / /sys/fs/cgroup/systemd rw shared:18 - cgroup cgroup rw,xattr,name=systemd
";

    #[test]
    fn cpu_weight_follows_nice_like_a_tasks() {
        // The scheduler's own table: 1024 at nice 0, 110 at 10, 15 at 19.
        assert_eq!(at_nice(1024, 0, SHARES), 1024);
        assert!((105..=115).contains(&at_nice(1024, 10, SHARES)));
        assert!((14..=16).contains(&at_nice(1024, 19, SHARES)));
        assert_eq!(at_nice(100, 19, WEIGHT), 1, "clamped to v2's floor");
        assert_eq!(at_nice(2048, -20, SHARES), 177_636);
        assert_eq!(cpu_millis_of(Some(200_000)), 2000);
        assert_eq!(cpu_millis_of(Some(-1)), 1000);
        assert_eq!(cpu_millis_of(None), 1000);
    }

    #[test]
    fn detects_v1_hybrid_with_comounted_cpu() {
        let Layout::V1(m) = parse_layout(HYBRID).unwrap() else {
            panic!("expected v1")
        };
        assert_eq!(m.cpu, Path::new("/sys/fs/cgroup/cpu,cpuacct"));
        assert_eq!(m.cpuacct, m.cpu);
        assert_eq!(m.memory, Path::new("/sys/fs/cgroup/memory"));
        // co-mounted cpu,cpuacct appears once
        assert_eq!(m.all().len(), 4);
        // systemd's hierarchies are joined too (tracking only, never mounted inside)
        assert_eq!(
            m.tracking,
            [
                PathBuf::from("/sys/fs/cgroup/unified"),
                PathBuf::from("/sys/fs/cgroup/systemd")
            ]
        );
        assert_eq!(m.joined().len(), 6);
        assert_eq!(
            m.hierarchies(),
            ["memory", "cpu,cpuacct", "pids", "freezer"]
        );
    }

    #[test]
    fn detects_v2() {
        let info = "25 20 0:23 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        assert!(
            matches!(parse_layout(info).unwrap(), Layout::V2(p) if p == Path::new("/sys/fs/cgroup"))
        );
    }

    #[test]
    fn missing_controllers_is_an_error() {
        let info = "34 30 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        let e = parse_layout(info).unwrap_err().to_string();
        assert!(e.contains("pids"), "{e}");
    }

    #[test]
    fn keyed_values() {
        let oom = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(keyed_value(oom, "oom_kill"), Some(3));
        assert_eq!(keyed_value(oom, "oom"), None);
        let cpu = "usage_usec 1500\nuser_usec 1000\n";
        assert_eq!(keyed_value(cpu, "usage_usec"), Some(1500));
    }

    #[test]
    fn cpu_conversions() {
        assert_eq!(cpu_quota_us(2000), 200_000);
        assert_eq!(cpu_quota_us(500), 50_000);
        assert_eq!(cpu_shares(1000), 1024);
        assert_eq!(cpu_weight(2000), 200);
        assert_eq!(cpu_weight(1), 1);
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cubicle-cg-unit-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    /// v2 limit files, written into a fake cgroup tree (plain files).
    #[test]
    fn v2_create_writes_limits() {
        let root = scratch("v2create");
        fs::write(
            root.join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .unwrap();
        fs::write(root.join("cgroup.subtree_control"), "").unwrap();
        let parent = root.join(PARENT);
        fs::create_dir(&parent).unwrap();
        fs::write(parent.join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        fs::write(parent.join("cgroup.subtree_control"), "memory\n").unwrap();
        let limits = Limits {
            memory_bytes: 256 << 20,
            cpu_millis: 2000,
            pids: 1024,
        };
        v2::create(&root, "abc", &limits).unwrap();
        let dir = parent.join("abc");
        let read = |f: &str| fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(read("memory.max"), "268435456");
        assert_eq!(read("cpu.max"), "200000 100000");
        assert_eq!(read("cpu.weight"), "200");
        assert_eq!(read("pids.max"), "1024");
        fs::remove_dir_all(&root).unwrap();
    }

    /// v1 limit files, written into a fake tree (plain files): the CFS period is written
    /// only where it is not already ours (a kernel file reads "100000\n"; a rewrite here
    /// would leave "100000"), and the tracking hierarchies get the shared parent only.
    #[test]
    fn v1_create_leaves_a_default_period_alone() {
        let root = scratch("v1create");
        let h = |n: &str| root.join(n);
        let m = v1::Mounts {
            memory: h("memory"),
            cpu: h("cpu"),
            cpuacct: h("cpu"),
            pids: h("pids"),
            freezer: h("freezer"),
            tracking: vec![h("unified")],
            unified: Some(h("unified")),
        };
        for d in ["memory", "cpu", "pids", "freezer", "unified"] {
            fs::create_dir_all(h(d)).unwrap();
        }
        let limits = Limits {
            memory_bytes: 256 << 20,
            cpu_millis: 2000,
            pids: 1024,
        };
        for (id, before, after) in [
            ("new", "100000\n", "100000\n"),
            ("odd", "50000\n", "100000"),
        ] {
            let cpu = h("cpu").join(PARENT).join(id);
            fs::create_dir_all(&cpu).unwrap();
            fs::write(cpu.join("cpu.cfs_period_us"), before).unwrap();
            v1::create(&m, id, &limits).unwrap();
            let read = |f: &str| fs::read_to_string(cpu.join(f)).unwrap();
            assert_eq!(read("cpu.cfs_period_us"), after, "{id}");
            assert_eq!(read("cpu.cfs_quota_us"), "200000", "{id}");
            assert!(h("pids").join(PARENT).join(id).join("pids.max").exists());
            assert!(h("unified").join(PARENT).is_dir());
            assert!(!h("unified").join(PARENT).join(id).exists(), "{id}");
        }
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn v2_create_requires_delegated_controllers() {
        let root = scratch("v2nodeleg");
        fs::write(root.join("cgroup.controllers"), "cpu\n").unwrap();
        fs::write(root.join("cgroup.subtree_control"), "").unwrap();
        let e = v2::create(&root, "abc", &Limits::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("memory"), "{e}");
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn v2_stats_parse() {
        let dir = scratch("v2stats");
        fs::write(dir.join("memory.current"), "1048576\n").unwrap();
        fs::write(dir.join("memory.peak"), "2097152\n").unwrap();
        fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n",
        )
        .unwrap();
        fs::write(
            dir.join("cpu.stat"),
            "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\n",
        )
        .unwrap();
        fs::write(dir.join("pids.current"), "3\n").unwrap();
        fs::write(dir.join("pids.events"), "max 2\n").unwrap();
        let s = v2::stats(&dir).unwrap();
        assert_eq!(
            s,
            CgroupStats {
                memory_bytes: 1 << 20,
                memory_peak_bytes: Some(2 << 20),
                cpu_usage_ns: 2_500_000,
                oom_kills: 1,
                pids: 3,
                pids_limit_hits: 2,
            }
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Real cgroup v2 membership, kill and removal, on this hybrid host's controller-less
    /// unified hierarchy (limits cannot be tested there).
    #[test]
    fn v2_kill_and_remove_on_real_unified_hierarchy() {
        let unified = Path::new("/sys/fs/cgroup/unified");
        if !cubicle_syscalls::is_root() || !unified.join("cgroup.kill").exists() {
            println!(
                "skipped: needs root and a cgroup2 mount with cgroup.kill at {}",
                unified.display()
            );
            return;
        }
        let id = format!("unitv2{}", std::process::id());
        let cg = Cgroup {
            id: id.clone(),
            layout: Layout::V2(unified.to_path_buf()),
        };
        let parent_existed = unified.join(PARENT).exists();
        fs::create_dir_all(unified.join(PARENT).join(&id)).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("100")
            .spawn()
            .unwrap();
        cg.add_process(child.id() as i32).unwrap();
        assert_eq!(cg.procs().unwrap(), vec![child.id() as i32]);
        cg.kill_all().unwrap();
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        cg.remove().unwrap();
        assert!(!cg.exists());
        if !parent_existed {
            let _ = fs::remove_dir(unified.join(PARENT));
        }
    }
}
