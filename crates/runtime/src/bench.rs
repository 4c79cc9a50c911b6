//! The spawn benchmark behind `cubicle bench`: how long from `spawn()` to "the sandbox's
//! init program is running", and how long `destroy()` takes, over many cold creates.

use std::os::fd::AsFd;
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
        collect_steps(&mut steps, sb.timings());
        let t = Instant::now();
        sb.destroy()?;
        destroy_t.push(t.elapsed());
        let _ = std::fs::remove_dir_all(&spec.sandbox_dir);
    }
    Ok(BenchReport {
        iterations,
        spawn: Percentiles::of(&spawn_t),
        destroy: Percentiles::of(&destroy_t),
        steps: step_percentiles(steps),
    })
}

/// Adds one run's step timings to `steps` (by step name, in first-seen order).
fn collect_steps(steps: &mut Vec<(String, Vec<Duration>)>, timings: &[(String, Duration)]) {
    for (name, d) in timings {
        match steps.iter_mut().find(|(s, _)| s == name) {
            Some((_, v)) => v.push(*d),
            None => steps.push((name.clone(), vec![*d])),
        }
    }
}

/// Each step's percentiles, in the order of their medians.
fn step_percentiles(steps: Vec<(String, Vec<Duration>)>) -> Vec<(String, Percentiles)> {
    let mut steps: Vec<(String, Percentiles)> = steps
        .into_iter()
        .map(|(n, v)| (n, Percentiles::of(&v)))
        .collect();
    steps.sort_by_key(|(_, p)| p.p50);
    steps
}

/// Result of [`volume_mount_cost`].
#[derive(Clone, Debug, Default)]
pub struct VolumeMountReport {
    /// Spawns without a volume.
    pub plain: Percentiles,
    /// Spawns with one idmapped volume bind (the cold create path).
    pub with_volume: Percentiles,
    /// [`crate::attach_binds`] of one volume into a running sandbox (a pool claim).
    pub attach: Percentiles,
    /// Per sandbox, the steps a bind adds work to (the helper's `id_maps_written` →
    /// `mounts_prepared`: clone and idmap the sources; the child's `pseudo_fs_mounted`
    /// → `rootfs_ready`: pivot and attach), without and with the volume: less noisy
    /// than whole spawns on a busy machine.
    pub bind_steps_plain: Percentiles,
    /// As `bind_steps_plain`, with the volume.
    pub bind_steps_with_volume: Percentiles,
}

impl std::fmt::Display for VolumeMountReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        writeln!(f, "  spawn, no volume      : {}", self.plain)?;
        writeln!(f, "  spawn, one volume     : {}", self.with_volume)?;
        writeln!(
            f,
            "  the volume adds (p50) : {:+.3} ms",
            ms(self.with_volume.p50) - ms(self.plain.p50)
        )?;
        writeln!(f, "  bind steps, no volume : {}", self.bind_steps_plain)?;
        writeln!(
            f,
            "  bind steps, one volume: {}",
            self.bind_steps_with_volume
        )?;
        writeln!(
            f,
            "  the volume adds to them (p50): {:+.3} ms",
            ms(self.bind_steps_with_volume.p50) - ms(self.bind_steps_plain.p50)
        )?;
        writeln!(f, "  attach to a running sandbox: {}", self.attach)
    }
}

/// What mounting a volume costs: spawns from `base` without and with an idmapped bind of
/// `volume` at `/mnt/volume`, interleaved (so drift hits both alike), and
/// [`crate::attach_binds`] of it into running sandboxes.
pub fn volume_mount_cost(
    base: &SandboxSpec,
    iterations: usize,
    dirs: &Path,
    volume: &Path,
) -> Result<VolumeMountReport> {
    let bind = crate::spec::BindMount {
        source: volume.to_path_buf(),
        target: "/mnt/volume".into(),
        readonly: false,
        idmapped: true,
    };
    let (mut plain, mut with, mut attach) = (Vec::new(), Vec::new(), Vec::new());
    let (mut steps_plain, mut steps_with) = (Vec::new(), Vec::new());
    let interval = |sb: &crate::Sandbox, from: &str, to: &str| {
        let at = |n: &str| sb.timings().iter().find(|(s, _)| s == n).map(|(_, d)| *d);
        match (at(from), at(to)) {
            (Some(a), Some(b)) => b.saturating_sub(a),
            _ => Duration::ZERO,
        }
    };
    for n in 0..iterations {
        for mounted in [false, true] {
            let mut spec = base.clone();
            spec.id = format!("{}{n}{}", base.id, if mounted { "v" } else { "p" });
            spec.sandbox_dir = dirs.join(&spec.id);
            spec.uid_base = base.uid_base + (n as u32 % 64) * spec.uid_count;
            if mounted {
                spec.binds.push(bind.clone());
            }
            let t = Instant::now();
            let sb = spawn(&spec)?;
            let dt = t.elapsed();
            let steps = interval(&sb, "id_maps_written", "mounts_prepared")
                + interval(&sb, "pseudo_fs_mounted", "rootfs_ready");
            if mounted {
                with.push(dt);
                steps_with.push(steps);
            } else {
                steps_plain.push(steps);
                plain.push(dt);
                let t = Instant::now();
                crate::attach_binds(
                    sb.pidfd().as_fd(),
                    sb.pid(),
                    spec.uid_base,
                    std::slice::from_ref(&bind),
                )?;
                attach.push(t.elapsed());
            }
            sb.destroy()?;
            let _ = std::fs::remove_dir_all(&spec.sandbox_dir);
        }
    }
    Ok(VolumeMountReport {
        plain: Percentiles::of(&plain),
        with_volume: Percentiles::of(&with),
        attach: Percentiles::of(&attach),
        bind_steps_plain: Percentiles::of(&steps_plain),
        bind_steps_with_volume: Percentiles::of(&steps_with),
    })
}

/// Result of [`shell_attach_cost`].
#[derive(Clone, Debug, Default)]
pub struct ShellReport {
    /// Sandboxes of each kind.
    pub iterations: usize,
    /// `spawn()` of the template's sandbox (a cold create's runtime part).
    pub spawn: Percentiles,
    /// [`crate::Sandbox::attach_root`] of the template to a running shell (what would
    /// be left of a cold create's runtime part with shells made ahead).
    pub attach: Percentiles,
    /// CPU time per sandbox (this process and the helpers, children and inits it
    /// reaped) of a template's sandbox spawned and destroyed.
    pub cycle_cpu: Duration,
    /// The same for a shell spawned and destroyed, never attached.
    pub shell_cycle_cpu: Duration,
    /// CPU time per attach (this process and the helper it reaped).
    pub attach_cpu: Duration,
    /// Time from the start of `attach_root` to each of its steps.
    pub attach_steps: Vec<(String, Percentiles)>,
}

impl std::fmt::Display for ShellReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        writeln!(f, "  spawn a template's sandbox : {}", self.spawn)?;
        writeln!(f, "  attach it to a shell       : {}", self.attach)?;
        writeln!(
            f,
            "  CPU per sandbox: spawn+destroy {:.3} ms; shell spawn+destroy {:.3} ms; attach {:.3} ms",
            ms(self.cycle_cpu),
            ms(self.shell_cycle_cpu),
            ms(self.attach_cpu)
        )?;
        writeln!(f, "  time since attach_root() start, per step:")?;
        for (step, p) in &self.attach_steps {
            writeln!(f, "    {step:<18} {p}")?;
        }
        Ok(())
    }
}

/// CPU time of this process and of the children it has reaped (user + system).
fn cpu_time() -> Duration {
    let of = |who| {
        // SAFETY: a zeroed rusage is a valid out buffer.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: valid `who` and out pointer.
        unsafe { libc::getrusage(who, &mut u) };
        let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
        tv(u.ru_utime) + tv(u.ru_stime)
    };
    of(libc::RUSAGE_SELF) + of(libc::RUSAGE_CHILDREN)
}

/// What a shell saves a cold create: per iteration, a sandbox of `base` spawned and
/// destroyed; a shell of the same spec spawned and destroyed; and a shell spawned, then
/// (timed) given `base`'s root with [`crate::Sandbox::attach_root`], then destroyed.
/// `shell_init` is the shells' init (its program must be reachable in a shell: under
/// `/run`, e.g. through `shell_binds`).
pub fn shell_attach_cost(
    base: &SandboxSpec,
    shell_init: &[String],
    shell_binds: &[crate::spec::BindMount],
    iterations: usize,
    dirs: &Path,
) -> Result<ShellReport> {
    let (mut spawn_t, mut attach_t) = (Vec::new(), Vec::new());
    let mut steps = Vec::new();
    let (mut cycle, mut shell_cycle, mut attach_cpu) =
        (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for n in 0..iterations {
        for kind in ["t", "s", "a"] {
            let mut spec = base.clone();
            spec.id = format!("{}{n}{kind}", base.id);
            spec.sandbox_dir = dirs.join(&spec.id);
            spec.uid_base = base.uid_base + (n as u32 % 64) * spec.uid_count;
            let mut shell = spec.clone();
            shell.shell = true;
            shell.init = shell_init.to_vec();
            shell.binds = shell_binds.to_vec();
            let c0 = cpu_time();
            let t = Instant::now();
            let sb = spawn(if kind == "t" { &spec } else { &shell })?;
            if kind == "t" {
                spawn_t.push(t.elapsed());
            }
            if kind == "a" {
                let (c, t) = (cpu_time(), Instant::now());
                let timings = sb.attach_root(&spec)?;
                attach_t.push(t.elapsed());
                collect_steps(&mut steps, &timings);
                attach_cpu += cpu_time() - c;
            }
            sb.destroy()?;
            match kind {
                "t" => cycle += cpu_time() - c0,
                "s" => shell_cycle += cpu_time() - c0,
                _ => {}
            }
            let _ = std::fs::remove_dir_all(&spec.sandbox_dir);
        }
    }
    let per = |d: Duration| d / iterations.max(1) as u32;
    Ok(ShellReport {
        iterations,
        spawn: Percentiles::of(&spawn_t),
        attach: Percentiles::of(&attach_t),
        cycle_cpu: per(cycle),
        shell_cycle_cpu: per(shell_cycle),
        attach_cpu: per(attach_cpu),
        attach_steps: step_percentiles(steps),
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
