//! `GET /metrics`: `{ts, cpu_count, cpu_used_pct, mem_total, mem_used, mem_cache,
//! mem_total_mib, mem_used_mib, disk_used, disk_total}` (bytes, unix seconds, percent).
//!
//! Sources, most specific first:
//! * CPU: the usage counter of envd's own cgroup (v2 `cpu.stat` `usage_usec`, v1
//!   `cpuacct.usage`), else `/proc/stat`; the percentage is the change since the previous
//!   call (or over a 100 ms sample on the first call or after a long pause), relative to
//!   `cpu_count` CPUs (`available_parallelism`, which honours affinity and CPU quotas).
//! * Memory: the cgroup's limit and usage when it has a limit below the machine's memory
//!   (v2 `memory.max`/`memory.current`, v1 `memory.limit_in_bytes`/`usage_in_bytes`;
//!   "used" excludes inactive page cache), else `/proc/meminfo` (`MemTotal −
//!   MemAvailable`, cache = `Cached + Buffers`).
//! * Disk: `statvfs("/")`.

use std::{
    collections::HashMap,
    ffi::CString,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{
    Json,
    extract::State,
    response::{IntoResponse, Response},
};
use serde::Serialize;

use super::HttpError;
use crate::server::AppState;

const MIB: u64 = 1024 * 1024;
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The `/metrics` answer.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct Metrics {
    pub ts: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_total: u64,
    pub mem_used: u64,
    pub mem_cache: u64,
    pub mem_total_mib: u64,
    pub mem_used_mib: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// `GET /metrics`.
pub(crate) async fn get_metrics(State(_state): State<Arc<AppState>>) -> Response {
    match tokio::task::spawn_blocking(collect).await {
        Ok(m) => Json(m).into_response(),
        Err(e) => HttpError::internal(format!("collecting metrics: {e}")).into_response(),
    }
}

/// Gathers the metrics now (blocks up to ~100 ms for a first CPU sample).
pub(crate) fn collect() -> Metrics {
    let cpu_count = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1);
    let cpu_used_pct = cpu_percent(cpu_count);
    let mem = memory();
    let (disk_used, disk_total) = disk("/");
    Metrics {
        ts: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0),
        cpu_count,
        cpu_used_pct,
        mem_total: mem.total,
        mem_used: mem.used,
        mem_cache: mem.cache,
        mem_total_mib: mem.total / MIB,
        mem_used_mib: mem.used / MIB,
        disk_used,
        disk_total,
    }
}

// ---- cgroups ----------------------------------------------------------------------

/// The directory of envd's cgroup for a v1 controller (`Some("memory")`) or for v2
/// (`None`), falling back to the hierarchy's root (inside a cgroup namespace the root
/// *is* our cgroup).
fn cgroup_dir(controller: Option<&str>) -> Option<PathBuf> {
    let root = Path::new(CGROUP_ROOT);
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let (base, rel) = match controller {
        None => {
            if !root.join("cgroup.controllers").exists() {
                return None;
            }
            let rel = own
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .unwrap_or("/")
                .to_string();
            (root.to_path_buf(), rel)
        }
        Some(c) => {
            let mut found = None;
            for line in own.lines() {
                let mut f = line.splitn(3, ':');
                let (_, ctrls, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or("/"));
                if ctrls.split(',').any(|x| x == c) {
                    found = Some((ctrls.to_string(), path.to_string()));
                    break;
                }
            }
            let (ctrls, rel) = found?;
            let base = [root.join(c), root.join(&ctrls)]
                .into_iter()
                .find(|p| p.is_dir())?;
            (base, rel)
        }
    };
    let own_dir = base.join(rel.trim_start_matches('/'));
    if own_dir.is_dir() {
        Some(own_dir)
    } else if base.is_dir() {
        Some(base)
    } else {
        None
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn read_kv(path: &Path) -> HashMap<String, u64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((
                f.next()?.trim_end_matches(':').to_string(),
                f.next()?.parse().ok()?,
            ))
        })
        .collect()
}

// ---- CPU ----------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum CpuCounter {
    /// Nanoseconds of CPU time used by the cgroup.
    Cgroup(u64),
    /// (busy, total) jiffies from /proc/stat.
    ProcStat(u64, u64),
}

fn cpu_counter() -> Option<CpuCounter> {
    if let Some(dir) = cgroup_dir(None)
        && let Some(us) = read_kv(&dir.join("cpu.stat")).get("usage_usec")
    {
        return Some(CpuCounter::Cgroup(us * 1000));
    }
    if let Some(dir) = cgroup_dir(Some("cpuacct"))
        && let Some(ns) = read_u64(&dir.join("cpuacct.usage"))
    {
        return Some(CpuCounter::Cgroup(ns));
    }
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    if v.len() < 4 {
        return None;
    }
    // user nice system idle iowait irq softirq steal (guest is included in user)
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    let total: u64 = v.iter().take(8).sum();
    Some(CpuCounter::ProcStat(total - idle, total))
}

static LAST_CPU: Mutex<Option<(Instant, CpuCounter)>> = Mutex::new(None);

fn cpu_percent(cpus: u32) -> f64 {
    let mut last = LAST_CPU.lock().unwrap_or_else(|e| e.into_inner());
    let previous = match *last {
        Some((at, c))
            if at.elapsed() >= Duration::from_millis(50)
                && at.elapsed() < Duration::from_secs(60) =>
        {
            Some((at, c))
        }
        _ => None,
    };
    let (then, before) = match previous {
        Some(p) => p,
        None => {
            let Some(c) = cpu_counter() else { return 0.0 };
            let at = Instant::now();
            std::thread::sleep(Duration::from_millis(100));
            (at, c)
        }
    };
    let Some(now_c) = cpu_counter() else {
        return 0.0;
    };
    let now = Instant::now();
    *last = Some((now, now_c));
    let pct = match (before, now_c) {
        (CpuCounter::Cgroup(a), CpuCounter::Cgroup(b)) => {
            let wall = now.duration_since(then).as_nanos() as f64 * cpus.max(1) as f64;
            if wall <= 0.0 {
                0.0
            } else {
                b.saturating_sub(a) as f64 / wall * 100.0
            }
        }
        (CpuCounter::ProcStat(b0, t0), CpuCounter::ProcStat(b1, t1)) => {
            let dt = t1.saturating_sub(t0);
            if dt == 0 {
                0.0
            } else {
                b1.saturating_sub(b0) as f64 / dt as f64 * 100.0
            }
        }
        _ => 0.0,
    };
    (pct.clamp(0.0, 100.0) * 100.0).round() / 100.0
}

// ---- memory -------------------------------------------------------------------------

struct Memory {
    total: u64,
    used: u64,
    cache: u64,
}

fn memory() -> Memory {
    let info = read_kv(Path::new("/proc/meminfo"));
    let kb = |k: &str| info.get(k).copied().unwrap_or(0) * 1024;
    let machine_total = kb("MemTotal");
    let available = info
        .get("MemAvailable")
        .map(|v| v * 1024)
        .unwrap_or(kb("MemFree") + kb("Cached"));
    let host = Memory {
        total: machine_total,
        used: machine_total.saturating_sub(available),
        cache: kb("Cached") + kb("Buffers"),
    };
    // A cgroup with a limit below the machine's memory describes the sandbox better.
    let limited = |limit: u64| limit > 0 && (machine_total == 0 || limit < machine_total);
    if let Some(dir) = cgroup_dir(None) {
        let limit = std::fs::read_to_string(dir.join("memory.max"))
            .ok()
            .and_then(|s| s.trim().parse().ok());
        if let (Some(limit), Some(usage)) = (limit, read_u64(&dir.join("memory.current")))
            && limited(limit)
        {
            let stat = read_kv(&dir.join("memory.stat"));
            let inactive = stat.get("inactive_file").copied().unwrap_or(0);
            return Memory {
                total: limit,
                used: usage.saturating_sub(inactive),
                cache: stat.get("file").copied().unwrap_or(0),
            };
        }
    }
    if let Some(dir) = cgroup_dir(Some("memory")) {
        let limit = read_u64(&dir.join("memory.limit_in_bytes"));
        if let (Some(limit), Some(usage)) = (limit, read_u64(&dir.join("memory.usage_in_bytes")))
            && limited(limit)
        {
            let stat = read_kv(&dir.join("memory.stat"));
            let inactive = stat
                .get("total_inactive_file")
                .or(stat.get("inactive_file"))
                .copied()
                .unwrap_or(0);
            return Memory {
                total: limit,
                used: usage.saturating_sub(inactive),
                cache: stat
                    .get("total_cache")
                    .or(stat.get("cache"))
                    .copied()
                    .unwrap_or(0),
            };
        }
    }
    host
}

// ---- disk ---------------------------------------------------------------------------

/// (used, total) bytes of the filesystem at `path`.
fn disk(path: &str) -> (u64, u64) {
    let Ok(c) = CString::new(path) else {
        return (0, 0);
    };
    // SAFETY: statvfs fills the zeroed struct; c is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above: a valid path and a struct statvfs to fill.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return (0, 0);
    }
    let frsize = st.f_frsize as u64;
    let total = st.f_blocks as u64 * frsize;
    let free = st.f_bfree as u64 * frsize;
    (total.saturating_sub(free), total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collects_plausible_numbers() {
        let m = collect();
        assert!(m.cpu_count >= 1);
        assert!((0.0..=100.0).contains(&m.cpu_used_pct));
        assert!(m.mem_total > 0 && m.mem_used <= m.mem_total, "{m:?}");
        assert_eq!(m.mem_total_mib, m.mem_total / MIB);
        assert!(m.disk_total > 0 && m.disk_used <= m.disk_total, "{m:?}");
        assert!(m.ts > 1_700_000_000);
        // A second call uses the previous sample (no 100 ms sleep needed, but valid).
        let again = collect();
        assert!((0.0..=100.0).contains(&again.cpu_used_pct));
    }
}
