//! Benchmarks (commands that print numbers, not tests): cold create-to-envd-ready
//! latency, and idle host memory per sandbox.

use std::time::Duration;

use crate::error::Result;
use crate::node::Node;
use crate::sandbox::CreateRequest;

/// Latency percentiles of a series of creates.
#[derive(Debug, Clone)]
pub struct LatencyReport {
    /// Template used.
    pub template: String,
    /// Whether the sandboxes had internet (veth + NAT).
    pub internet: bool,
    /// Number of creates measured.
    pub n: usize,
    /// 50th percentile.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Fastest.
    pub min: Duration,
    /// Slowest.
    pub max: Duration,
    /// Mean.
    pub mean: Duration,
}

impl std::fmt::Display for LatencyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cold create->envd ready, template {}{}: n={} p50={:.2}ms p99={:.2}ms min={:.2}ms max={:.2}ms mean={:.2}ms",
            self.template,
            if self.internet {
                " (internet on)"
            } else {
                " (no internet)"
            },
            self.n,
            ms(self.p50),
            ms(self.p99),
            ms(self.min),
            ms(self.max),
            ms(self.mean)
        )
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Nearest-rank percentile of sorted samples.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Create and kill `n` sandboxes of `template` one after another; the latency measured
/// is the node's create (from request to envd's `/init` answered). The template is built
/// first if needed and one warm-up create is not counted.
pub async fn create_latency(
    node: &Node,
    template: &str,
    n: usize,
    internet: bool,
) -> Result<LatencyReport> {
    let req = || CreateRequest {
        template: template.to_string(),
        internet,
        ..Default::default()
    };
    let w = node.create(req()).await?;
    node.kill(&w.id).await?;
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let info = node.create(req()).await?;
        samples.push(Duration::from_micros(info.ready_us));
        node.kill(&info.id).await?;
    }
    samples.sort();
    let sum: Duration = samples.iter().sum();
    Ok(LatencyReport {
        template: template.to_string(),
        internet,
        n,
        p50: percentile(&samples, 50.0),
        p99: percentile(&samples, 99.0),
        min: samples.first().copied().unwrap_or_default(),
        max: samples.last().copied().unwrap_or_default(),
        mean: if n == 0 {
            Duration::ZERO
        } else {
            sum / n as u32
        },
    })
}

/// Idle memory per sandbox.
#[derive(Debug, Clone)]
pub struct MemoryReport {
    /// Template used.
    pub template: String,
    /// Sandboxes alive during the measurement.
    pub n: usize,
    /// Drop of the host's MemAvailable, divided by `n`, in bytes.
    pub host_per_sandbox: u64,
    /// Mean cgroup memory usage per sandbox, in bytes.
    pub cgroup_per_sandbox: u64,
    /// Mean proportional set size of the sandbox's init (envd), in bytes.
    pub init_pss_per_sandbox: u64,
}

impl std::fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "idle memory, template {}, {} sandboxes: cgroup {:.2} MiB/sandbox, envd PSS {:.2} MiB/sandbox, host MemAvailable drop {:.2} MiB/sandbox (noisy on a shared host)",
            self.template,
            self.n,
            self.cgroup_per_sandbox as f64 / 1048576.0,
            self.init_pss_per_sandbox as f64 / 1048576.0,
            self.host_per_sandbox as f64 / 1048576.0,
        )
    }
}

/// `MemAvailable` from /proc/meminfo, in bytes.
pub fn mem_available() -> u64 {
    crate::host::memory_available()
}

/// Start `n` idle sandboxes, wait for them to settle, measure, kill them all.
pub async fn idle_memory(node: &Node, template: &str, n: usize) -> Result<MemoryReport> {
    let w = node
        .create(CreateRequest {
            template: template.to_string(),
            ..Default::default()
        })
        .await?;
    node.kill(&w.id).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = mem_available();
    let mut ids = Vec::with_capacity(n);
    let mut result = Ok(());
    for _ in 0..n {
        match node
            .create(CreateRequest {
                template: template.to_string(),
                ..Default::default()
            })
            .await
        {
            Ok(i) => ids.push(i.id),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = mem_available();
    let cg: u64 = ids.iter().filter_map(|id| node.memory_usage(id)).sum();
    let pss: u64 = ids
        .iter()
        .filter_map(|id| node.get(id).ok()?.pid)
        .filter_map(pss_bytes)
        .sum();
    for id in &ids {
        let _ = node.kill(id).await;
    }
    result?;
    let k = ids.len().max(1) as u64;
    Ok(MemoryReport {
        template: template.to_string(),
        n: ids.len(),
        host_per_sandbox: before.saturating_sub(after) / k,
        cgroup_per_sandbox: cg / k,
        init_pss_per_sandbox: pss / k,
    })
}

/// `Pss` of a process (from /proc/PID/smaps_rollup), in bytes.
pub fn pss_bytes(pid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let kb: u64 = s
        .lines()
        .find(|l| l.starts_with("Pss:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&v, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
    }
}
