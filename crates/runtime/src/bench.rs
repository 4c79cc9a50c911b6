//! The spawn benchmark behind `cubicle bench`: how long from `spawn()` to "the sandbox's
//! init program is running", and how long `destroy()` takes, over many cold creates.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::sandbox::spawn;
use crate::spec::SandboxSpec;

/// Percentiles of a set of durations.
#[derive(Clone, Debug, Default)]
pub struct Percentiles {
    pub p50: Duration,
    pub p90: Duration,
    pub p99: Duration,
    pub max: Duration,
    pub mean: Duration,
}

impl Percentiles {
    /// Computes percentiles (nearest-rank) of `samples`.
    pub fn of(samples: &[Duration]) -> Percentiles {
        if samples.is_empty() {
            return Percentiles::default();
        }
        let mut s = samples.to_vec();
        s.sort();
        let rank = |q: f64| s[((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1];
        let total: Duration = s.iter().sum();
        Percentiles {
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: s[s.len() - 1],
            mean: total / s.len() as u32,
        }
    }
}

impl std::fmt::Display for Percentiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        write!(
            f,
            "p50 {:7.2} ms  p90 {:7.2} ms  p99 {:7.2} ms  max {:7.2} ms  mean {:7.2} ms",
            ms(self.p50),
            ms(self.p90),
            ms(self.p99),
            ms(self.max),
            ms(self.mean)
        )
    }
}

/// Result of [`spawn_latency`].
#[derive(Clone, Debug, Default)]
pub struct BenchReport {
    pub iterations: usize,
    /// `spawn()` call → init exec'd (spawn returned).
    pub spawn: Percentiles,
    /// `destroy()` duration.
    pub destroy: Percentiles,
    /// Time from the start of `spawn()` to each setup step (see [`crate::Sandbox::timings`]).
    pub steps: Vec<(String, Percentiles)>,
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{} cold creates", self.iterations)?;
        writeln!(f, "  spawn -> init running : {}", self.spawn)?;
        writeln!(f, "  destroy               : {}", self.destroy)?;
        writeln!(f, "  time since spawn() start, per step:")?;
        for (step, p) in &self.steps {
            writeln!(f, "    {step:<18} {p}")?;
        }
        Ok(())
    }
}

/// Spawns and destroys `iterations` sandboxes made from `base` (each with id
/// `<base.id><n>`, its own directory under `dirs` and uid range `base.uid_base + n*65536`)
/// and measures each step. `base.init` should start quickly and keep running (e.g.
/// `sleep`), so that destroy measures a real kill.
pub fn spawn_latency(base: &SandboxSpec, iterations: usize, dirs: &Path) -> Result<BenchReport> {
    let mut spawn_t = Vec::with_capacity(iterations);
    let mut destroy_t = Vec::with_capacity(iterations);
    let mut steps: Vec<(String, Vec<Duration>)> = Vec::new();
    for n in 0..iterations {
        let mut spec = base.clone();
        spec.id = format!("{}{n}", base.id);
        spec.sandbox_dir = dirs.join(&spec.id);
        spec.uid_base = base.uid_base + (n as u32 % 64) * spec.uid_count;
        let t = Instant::now();
        let sb = spawn(&spec)?;
        spawn_t.push(t.elapsed());
        for (name, d) in sb.timings() {
            match steps.iter_mut().find(|(s, _)| s == name) {
                Some((_, v)) => v.push(*d),
                None => steps.push((name.clone(), vec![*d])),
            }
        }
        let t = Instant::now();
        sb.destroy()?;
        destroy_t.push(t.elapsed());
        let _ = std::fs::remove_dir_all(&spec.sandbox_dir);
    }
    let mut steps: Vec<(String, Percentiles)> = steps
        .into_iter()
        .map(|(n, v)| (n, Percentiles::of(&v)))
        .collect();
    steps.sort_by_key(|(_, p)| p.p50);
    Ok(BenchReport {
        iterations,
        spawn: Percentiles::of(&spawn_t),
        destroy: Percentiles::of(&destroy_t),
        steps,
    })
}

/// Host memory cost of idle sandboxes: `MemAvailable` before and after starting `count`
/// sandboxes from `base` (ids `<base.id>i<n>`), divided by `count`. Includes the kernel
/// objects (namespaces, mounts, cgroups, page tables) and the init process itself.
pub fn idle_memory_per_sandbox(base: &SandboxSpec, count: usize, dirs: &Path) -> Result<u64> {
    fn mem_available() -> u64 {
        std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| crate::cgroup::keyed_value(&m.replace(':', " "), "MemAvailable"))
            .unwrap_or(0)
            * 1024
    }
    let before = mem_available();
    let mut sandboxes = Vec::with_capacity(count);
    let mut result = Ok(());
    for n in 0..count {
        let mut spec = base.clone();
        spec.id = format!("{}i{n}", base.id);
        spec.sandbox_dir = dirs.join(&spec.id);
        spec.uid_base = base.uid_base + (n as u32) * spec.uid_count;
        match spawn(&spec) {
            Ok(sb) => sandboxes.push((sb, spec.sandbox_dir)),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = mem_available();
    for (sb, dir) in sandboxes {
        let _ = sb.destroy();
        let _ = std::fs::remove_dir_all(dir);
    }
    result?;
    Ok(before.saturating_sub(after) / count.max(1) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let p = Percentiles::of(&v);
        assert_eq!(p.p50, Duration::from_millis(50));
        assert_eq!(p.p99, Duration::from_millis(99));
        assert_eq!(p.max, Duration::from_millis(100));
        assert_eq!(Percentiles::of(&[]).p50, Duration::ZERO);
    }
}
