//! What a sandbox leaves on the host, kind by kind: for tests ("nothing left") and for
//! operators checking a host. Each trace is a human-readable line naming the object.

use std::path::Path;

/// Host-side traces of sandbox `id` (with its `slot` and init `pid` if known) under
/// `state_dir`: live init process, cgroups `cubicle/<id>` in any hierarchy, processes in
/// them, mounts mentioning its directory, its host veth `cbs<slot>`, its directory.
pub fn leftovers(state_dir: &Path, id: &str, slot: Option<u32>, pid: Option<i32>) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(pid) = pid
        && crate::procfs::is_alive(pid, None)
        && std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .is_ok_and(|c| c.contains(&format!("cubicle/{id}")))
    {
        out.push(format!("process {pid} (init of {id})"));
    }
    for dir in cgroup_dirs(id) {
        if dir.exists() {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            let n = procs.lines().count();
            out.push(format!("cgroup {} ({n} processes)", dir.display()));
        }
    }
    let sdir = state_dir.join("sandboxes").join(id);
    for m in crate::fsutil::mounts_under(&sdir) {
        out.push(format!("mount {}", m.display()));
    }
    if let Some(slot) = slot {
        let ifname = format!("cbs{slot}");
        if Path::new("/sys/class/net").join(&ifname).exists() {
            out.push(format!("veth {ifname}"));
        }
    }
    if sdir.exists() {
        out.push(format!("directory {}", sdir.display()));
    }
    out
}

/// Every place a `cubicle/<id>` cgroup can live (v1 controllers and v2).
pub fn cgroup_dirs(id: &str) -> Vec<std::path::PathBuf> {
    let mut v = vec![Path::new("/sys/fs/cgroup/cubicle").join(id)];
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        for e in rd.flatten() {
            let p = e.path().join("cubicle").join(id);
            if !v.contains(&p) {
                v.push(p);
            }
        }
    }
    v
}

/// Pids in sandbox `id`'s cgroups (any hierarchy), each once.
pub fn pids(id: &str) -> Vec<i32> {
    let mut out: Vec<i32> = cgroup_dirs(id)
        .iter()
        .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Ids of every `cubicle/<id>` cgroup on the host (any hierarchy).
pub fn all_sandbox_cgroups() -> Vec<String> {
    let mut ids = Vec::new();
    let mut parents = vec![Path::new("/sys/fs/cgroup/cubicle").to_path_buf()];
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        parents.extend(rd.flatten().map(|e| e.path().join("cubicle")));
    }
    for p in parents {
        if let Ok(rd) = std::fs::read_dir(&p) {
            for e in rd.flatten() {
                if e.path().is_dir() {
                    let n = e.file_name().to_string_lossy().into_owned();
                    if !ids.contains(&n) {
                        ids.push(n);
                    }
                }
            }
        }
    }
    ids
}
