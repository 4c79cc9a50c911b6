//! Facts about the host the node runs on: CPUs and their time, memory, and the disk that
//! holds the state directory. Read on demand (a few small `/proc` files and one
//! `statvfs`), for operators' metrics and for sizing defaults such as the warm pool.

use std::path::Path;

/// A snapshot of the host's resources.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostStats {
    /// Online CPUs.
    pub cpus: u32,
    /// CPU time since boot, all CPUs, in seconds, per mode (`user`, `nice`, `system`,
    /// `idle`, `iowait`, `irq`, `softirq`, `steal`), from `/proc/stat`.
    pub cpu_seconds: Vec<(&'static str, f64)>,
    /// `MemTotal`, in bytes.
    pub memory_total: u64,
    /// `MemAvailable`, in bytes.
    pub memory_available: u64,
    /// Size of the filesystem holding the state directory, in bytes.
    pub disk_total: u64,
    /// Bytes an unprivileged writer could still use on it (root may have a reserve more).
    pub disk_available: u64,
}

/// The modes of `/proc/stat`'s `cpu` line, in its order.
const CPU_MODES: [&str; 8] = [
    "user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal",
];

/// Reads the host's stats; `state_dir` names the filesystem whose space is reported.
/// Values that cannot be read are 0 (a metric that reads 0 is better than none).
pub fn stats(state_dir: &Path) -> HostStats {
    let (disk_total, disk_available) = disk_space(state_dir).unwrap_or((0, 0));
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    HostStats {
        cpus: std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1),
        cpu_seconds: cpu_seconds(&std::fs::read_to_string("/proc/stat").unwrap_or_default()),
        memory_total: meminfo_bytes(&meminfo, "MemTotal"),
        memory_available: meminfo_bytes(&meminfo, "MemAvailable"),
        disk_total,
        disk_available,
    }
}

/// `MemTotal` in bytes (0 when unreadable).
pub fn memory_total() -> u64 {
    meminfo_bytes(
        &std::fs::read_to_string("/proc/meminfo").unwrap_or_default(),
        "MemTotal",
    )
}

/// `MemAvailable` in bytes (0 when unreadable).
pub fn memory_available() -> u64 {
    meminfo_bytes(
        &std::fs::read_to_string("/proc/meminfo").unwrap_or_default(),
        "MemAvailable",
    )
}

/// The value of `key` in `/proc/meminfo` text, in bytes.
fn meminfo_bytes(meminfo: &str, key: &str) -> u64 {
    meminfo
        .lines()
        .find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
        .unwrap_or(0)
        * 1024
}

/// The aggregate `cpu` line of `/proc/stat` text, per mode, in seconds.
fn cpu_seconds(stat: &str) -> Vec<(&'static str, f64)> {
    // SAFETY: sysconf takes an integer and returns one.
    let hz = match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        n if n > 0 => n as f64,
        _ => 100.0,
    };
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return Vec::new();
    };
    CPU_MODES
        .iter()
        .zip(line.split_whitespace().skip(1))
        .filter_map(|(mode, v)| Some((*mode, v.parse::<u64>().ok()? as f64 / hz)))
        .collect()
}

/// Busy CPU time since boot, all CPUs, in seconds: the `user`, `nice`, `system`, `irq`
/// and `softirq` time of `/proc/stat` (idle, iowait and a hypervisor's steal are not
/// the host's work); `None` where it cannot be read.
pub fn cpu_busy_seconds() -> Option<f64> {
    busy_seconds(&cpu_seconds(&std::fs::read_to_string("/proc/stat").ok()?))
}

/// The busy modes' sum of [`cpu_seconds`]' output; `None` if one is missing.
fn busy_seconds(modes: &[(&'static str, f64)]) -> Option<f64> {
    ["user", "nice", "system", "irq", "softirq"]
        .iter()
        .map(|m| modes.iter().find(|(n, _)| n == m).map(|(_, v)| *v))
        .sum()
}

/// (total, available) bytes of the filesystem holding `path`.
fn disk_space(path: &Path) -> Option<(u64, u64)> {
    cubicle_syscalls::fs::disk_space(path).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_meminfo_and_stat() {
        let mi = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   12288000 kB\n";
        assert_eq!(meminfo_bytes(mi, "MemTotal"), 24_576_000 * 1024);
        assert_eq!(meminfo_bytes(mi, "MemAvailable"), 12_288_000 * 1024);
        assert_eq!(meminfo_bytes(mi, "Missing"), 0);
        let st = "cpu  100 0 50 1000 5 0 1 0 0 0\ncpu0 50 0 25 500 2 0 0 0 0 0\n";
        let s = cpu_seconds(st);
        assert_eq!(s.len(), 8);
        assert_eq!(s[0].0, "user");
        assert!(s[0].1 > 0.0 && s[3].1 > s[0].1);
    }

    #[test]
    fn busy_time_adds_user_nice_system_irq_softirq() {
        // Seconds per clock tick, as `cpu_seconds` converts them.
        let tick = cpu_seconds("cpu  100 0 0 0 0 0 0 0\n")[0].1 / 100.0;
        let stat = "cpu  100 20 300 9000 50 4 6 70 0 0\ncpu0 50 10 150 4500 25 2 3 35 0 0\n";
        let busy = busy_seconds(&cpu_seconds(stat)).unwrap();
        assert!(
            (busy - (100 + 20 + 300 + 4 + 6) as f64 * tick).abs() < 1e-9,
            "{busy}"
        );
        assert_eq!(busy_seconds(&cpu_seconds("cpu0 1 2 3 4 5 6 7\n")), None);
        assert_eq!(busy_seconds(&cpu_seconds("cpu  1 2 x 4 5 6 7\n")), None);
        assert_eq!(busy_seconds(&cpu_seconds("cpu  1 2 3 4 5\n")), None);
        assert!(cpu_busy_seconds().is_some(), "this machine has /proc/stat");
    }

    #[test]
    fn reads_this_host() {
        let s = stats(Path::new("/"));
        assert!(
            s.cpus >= 1 && s.memory_total > 0 && s.disk_total > 0,
            "{s:?}"
        );
        assert!(s.memory_available <= s.memory_total);
        assert!(s.cpu_seconds.iter().any(|(m, v)| *m == "idle" && *v > 0.0));
    }
}
