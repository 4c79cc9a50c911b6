//! cgroup v2 backend: `/sys/fs/cgroup/cubicle/<id>` with memory, cpu and pids enabled.

use std::path::Path;
use std::time::{Duration, Instant};

use super::{
    CPU_PERIOD_US, Cgroup, CgroupStats, PARENT, cpu_quota_us, cpu_weight, keyed_value, read_file,
    read_u64, write_file,
};
use crate::error::{Error, Result, io_ctx};
use crate::spec::Limits;

const CONTROLLERS: &[&str] = &["memory", "cpu", "pids"];

/// Enables `CONTROLLERS` in `dir/cgroup.subtree_control` (those not yet enabled).
fn enable_controllers(dir: &Path) -> Result<()> {
    let enabled = read_file(&dir.join("cgroup.subtree_control"))?;
    let available = read_file(&dir.join("cgroup.controllers"))?;
    for c in CONTROLLERS {
        if enabled.split_whitespace().any(|e| e == *c) {
            continue;
        }
        if !available.split_whitespace().any(|a| a == *c) {
            return Err(Error::Cgroup(format!(
                "controller {c} not available in {} (delegate it to this cgroup)",
                dir.display()
            )));
        }
        write_file(&dir.join("cgroup.subtree_control"), &format!("+{c}"))?;
    }
    Ok(())
}

pub(crate) fn create(root: &Path, id: &str, limits: &Limits) -> Result<()> {
    let parent = root.join(PARENT);
    enable_controllers(root)?;
    match std::fs::create_dir(&parent) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_ctx(|| format!("mkdir {}", parent.display()))(e)),
    }
    enable_controllers(&parent)?;
    let dir = parent.join(id);
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_ctx(|| format!("mkdir {}", dir.display()))(e)),
    }
    write_file(&dir.join("memory.max"), &limits.memory_bytes.to_string())?;
    let swap = dir.join("memory.swap.max");
    if swap.exists() {
        write_file(&swap, "0")?;
    }
    write_file(
        &dir.join("cpu.max"),
        &format!("{} {CPU_PERIOD_US}", cpu_quota_us(limits.cpu_millis)),
    )?;
    write_file(
        &dir.join("cpu.weight"),
        &cpu_weight(limits.cpu_millis).to_string(),
    )?;
    write_file(&dir.join("pids.max"), &limits.pids.to_string())?;
    Ok(())
}

/// The cgroup's memory usage counter (`memory.current`).
pub(crate) fn memory_bytes(dir: &Path) -> Result<u64> {
    read_u64(&dir.join("memory.current"))
}

pub(crate) fn stats(dir: &Path) -> Result<CgroupStats> {
    let events = read_file(&dir.join("memory.events"))?;
    let cpu = read_file(&dir.join("cpu.stat"))?;
    let pids_events = read_file(&dir.join("pids.events")).unwrap_or_default();
    Ok(CgroupStats {
        memory_bytes: memory_bytes(dir)?,
        memory_peak_bytes: read_u64(&dir.join("memory.peak")).ok(),
        cpu_usage_ns: keyed_value(&cpu, "usage_usec")
            .unwrap_or(0)
            .saturating_mul(1000),
        oom_kills: keyed_value(&events, "oom_kill").unwrap_or(0),
        pids: read_u64(&dir.join("pids.current"))?,
        pids_limit_hits: keyed_value(&pids_events, "max").unwrap_or(0),
    })
}

/// `cgroup.kill` (Linux 5.14+); on older kernels, SIGKILL each member until empty.
pub(crate) fn kill_all(dir: &Path, cg: &Cgroup, deadline: Instant) -> Result<()> {
    let kill = dir.join("cgroup.kill");
    if kill.exists() {
        return write_file(&kill, "1");
    }
    write_file(&dir.join("cgroup.freeze"), "1")?;
    loop {
        let procs = cg.procs()?;
        for pid in &procs {
            // SAFETY: kill with integer arguments.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
        if procs.is_empty() || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    write_file(&dir.join("cgroup.freeze"), "0")
}
