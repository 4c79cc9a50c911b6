//! What "the host is unchanged" means after an attack: a [`HostSnapshot`] taken before
//! and after every attack (its sandboxes killed) must be equal.
//!
//! It holds host-wide state an escaped sandbox would change and that nothing else on a
//! test machine touches: loaded kernel modules, the sysctls classic escapes write
//! (`core_pattern`, `modprobe`, `uevent_helper`, …), every cgroup v1 `release_agent`,
//! the host's hostname, the mounts under this test's state dir, the files at the host
//! paths attacks aim at (the envd binary, `/etc/passwd`, the escape marker), the
//! neighbour entries on this node's sandbox interfaces, and whether the quota
//! filesystem is still `nosuid,nodev`. Other helpers' mounts and sandboxes on a shared
//! machine change all the time and are deliberately not part of it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where an escaped attack would leave its mark on the host (checked to be absent).
pub const MARKER: &str = "/tmp/cubicle-escape-marker";

/// Host-wide state, as text, by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSnapshot(pub BTreeMap<String, String>);

const SYSCTLS: &[&str] = &[
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/kernel/modprobe",
    "/proc/sys/kernel/hostname",
    "/proc/sys/kernel/domainname",
    "/proc/sys/kernel/panic",
    "/proc/sys/kernel/sysrq",
    "/proc/sys/kernel/hotplug",
    "/proc/sys/kernel/randomize_va_space",
    "/proc/sys/kernel/unprivileged_bpf_disabled",
    "/proc/sys/kernel/perf_event_paranoid",
    "/proc/sys/vm/overcommit_memory",
    "/proc/sys/fs/protected_symlinks",
    "/sys/kernel/uevent_helper",
    "/proc/sys/net/ipv4/neigh/default/gc_thresh3",
];

impl HostSnapshot {
    /// Takes a snapshot. `state` is the node's state dir, `envd` the envd binary every
    /// sandbox runs. With `shells` the neighbour entries are left out: the shell an
    /// attack claimed is replaced by one on another interface.
    pub fn take(state: &Path, envd: &Path, shells: bool) -> HostSnapshot {
        let mut m = BTreeMap::new();
        let text = |p: &Path| match std::fs::read(p) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) => format!("<{}>", e.kind()),
        };
        // Module names and states (not sizes or reference counts, which move).
        let modules = text(Path::new("/proc/modules"))
            .lines()
            .map(|l| l.split_whitespace().next().unwrap_or("").to_string())
            .collect::<Vec<_>>()
            .join(",");
        m.insert("kernel modules".into(), modules);
        for s in SYSCTLS {
            m.insert(s.to_string(), text(Path::new(s)));
        }
        for (path, value) in release_agents() {
            m.insert(path.display().to_string(), value);
        }
        let mounts: Vec<PathBuf> = cubicle_node::fsutil::mounts_under(state);
        m.insert("mounts under the state dir".into(), format!("{mounts:?}"));
        m.insert(
            "mounts at /mnt".into(),
            format!(
                "{:?}",
                cubicle_node::fsutil::mounts_under(Path::new("/mnt"))
            ),
        );
        for f in [envd, Path::new("/etc/passwd"), Path::new(MARKER)] {
            m.insert(format!("file {}", f.display()), digest(f));
        }
        if !shells {
            m.insert("neighbours on sandbox veths".into(), sandbox_neighbours());
        }
        m.insert(
            "quota filesystem mount flags".into(),
            mount_flags(&state.join("sandboxes")),
        );
        HostSnapshot(m)
    }

    /// The entries that differ, as `name: before → after` lines.
    pub fn diff(&self, after: &HostSnapshot) -> Vec<String> {
        let mut out = Vec::new();
        for (k, v) in &self.0 {
            let a = after.0.get(k).map(String::as_str).unwrap_or("<missing>");
            if a != v {
                out.push(format!("{k}: {v:?} -> {a:?}"));
            }
        }
        out
    }
}

/// `release_agent` of every cgroup v1 hierarchy root (`notify_on_release` too).
fn release_agents() -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") else {
        return out;
    };
    for e in rd.flatten() {
        for f in ["release_agent", "notify_on_release"] {
            let p = e.path().join(f);
            if let Ok(v) = std::fs::read_to_string(&p) {
                out.push((p, v));
            }
        }
    }
    out
}

/// Size and a cheap hash of a file, or why it cannot be read.
fn digest(p: &Path) -> String {
    match std::fs::read(p) {
        Ok(b) => {
            // FNV-1a: enough to notice a change, no extra dependency.
            let h = b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
                (h ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3)
            });
            format!("{} bytes, fnv {h:016x}", b.len())
        }
        Err(e) => format!("<{}>", e.kind()),
    }
}

/// Neighbour entries on `cbs*` interfaces, in this network namespace (`ip neigh`).
fn sandbox_neighbours() -> String {
    let out = std::process::Command::new("ip")
        .args(["-4", "neigh", "show"])
        .output();
    match out {
        Ok(o) => {
            let mut lines: Vec<String> = String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.contains(" dev cbs"))
                // The state (REACHABLE, STALE…) moves by itself; the entries must not.
                .map(|l| l.split(" lladdr").next().unwrap_or(l).to_string())
                .collect();
            lines.sort();
            lines.join("; ")
        }
        Err(e) => format!("<ip: {e}>"),
    }
}

/// `nosuid`/`nodev` of the mount at `p`, from statvfs.
fn mount_flags(p: &Path) -> String {
    match nix::sys::statvfs::statvfs(p) {
        Ok(v) => {
            let f = v.flags();
            format!(
                "nosuid={} nodev={}",
                f.contains(nix::sys::statvfs::FsFlags::ST_NOSUID),
                f.contains(nix::sys::statvfs::FsFlags::ST_NODEV)
            )
        }
        Err(e) => format!("<{e}>"),
    }
}
