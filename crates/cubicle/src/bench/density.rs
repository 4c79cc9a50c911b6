//! `density`: N idle sandboxes; host memory per sandbox = Δ(MemTotal − MemAvailable)/N,
//! the RSS/PSS of the processes in their cgroups, the kernel's growth by field and slab
//! cache, and the p99 of `GET /health` round trips to all of them (`docs/bench.md`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use serde_json::{Value, json};

use super::Ctx;
use super::api::{Sbx, drive, note_errors};
use super::report::{Row, ms, pct};

/// Kernel-side /proc/meminfo fields (KiB) whose growth explains a sandbox's cost.
const KERNEL_FIELDS: &[&str] = &["Slab:", "Percpu:", "KernelStack:", "PageTables:", "Shmem:"];

fn meminfo_fields() -> BTreeMap<String, u64> {
    let s = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    s.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            let v = v.split_whitespace().next()?.parse().ok()?;
            Some((format!("{k}:"), v))
        })
        .filter(|(k, _)| KERNEL_FIELDS.contains(&k.as_str()))
        .collect()
}

/// Bytes held by each slab cache (`/proc/slabinfo`: objects × object size).
fn slab_bytes() -> BTreeMap<String, u64> {
    let s = std::fs::read_to_string("/proc/slabinfo").unwrap_or_default();
    s.lines()
        .skip(2)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let objs: u64 = f.get(2)?.parse().ok()?;
            let size: u64 = f.get(3)?.parse().ok()?;
            Some((f[0].to_string(), objs * size))
        })
        .collect()
}

/// The `top` slab caches by growth from `before` to `after`, KiB per sandbox.
fn slab_growth(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    held: usize,
    top: usize,
) -> Value {
    let mut d: Vec<(String, u64)> = after
        .iter()
        .map(|(k, a)| {
            (
                k.clone(),
                a.saturating_sub(before.get(k).copied().unwrap_or(0)),
            )
        })
        .filter(|(_, d)| *d > 0)
        .collect();
    d.sort_by_key(|e| std::cmp::Reverse(e.1));
    let held = held.max(1) as f64;
    Value::Object(
        d.into_iter()
            .take(top)
            .map(|(k, v)| (k, json!((v as f64 / held / 1024.0 * 10.0).round() / 10.0)))
            .collect(),
    )
}

/// Field `name` (with its colon, e.g. `MemTotal:`) of `/proc/meminfo`'s text, in KiB.
fn meminfo_kib(meminfo: &str, name: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix(name))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `MemTotal - MemAvailable` in KiB.
fn used_kib() -> anyhow::Result<u64> {
    let s = std::fs::read_to_string("/proc/meminfo")?;
    let field =
        |name: &str| meminfo_kib(&s, name).ok_or_else(|| anyhow!("/proc/meminfo has no {name}"));
    Ok(field("MemTotal:")? - field("MemAvailable:")?)
}

/// Kernel memory (KiB of `SUnreclaim`) one empty memory cgroup costs on this host now:
/// mostly its shrinker map (`mm/shrinker.c`: a 520-byte `kmalloc-1k` unit per 64
/// memcg-aware shrinkers, one per superblock), sized by the most superblocks this boot
/// ever had at once. Every sandbox has a memory cgroup and a few superblocks of its own,
/// so this part of a sandbox's cost grows with N and never shrinks until a reboot.
/// `None` where no memory cgroup can be made (not root, no memory controller).
fn empty_memcg_kib() -> Option<u64> {
    let v1 = Path::new("/sys/fs/cgroup/memory");
    let base = if v1.is_dir() {
        v1.to_path_buf()
    } else {
        let v2 = Path::new("/sys/fs/cgroup");
        let controls = std::fs::read_to_string(v2.join("cgroup.subtree_control")).ok()?;
        if !controls.split_whitespace().any(|c| c == "memory") {
            return None;
        }
        v2.to_path_buf()
    };
    const PROBES: usize = 16;
    let dirs: Vec<PathBuf> = (0..PROBES)
        .map(|i| base.join(format!("cubicle-bench-probe-{}-{i}", std::process::id())))
        .collect();
    let sunreclaim = || {
        meminfo_kib(
            &std::fs::read_to_string("/proc/meminfo").ok()?,
            "SUnreclaim:",
        )
    };
    let before = sunreclaim()?;
    let made = dirs
        .iter()
        .filter(|d| std::fs::create_dir(d).is_ok())
        .count();
    let after = sunreclaim();
    for d in &dirs {
        let _ = std::fs::remove_dir(d);
    }
    (made > 0).then(|| after.map(|a| a.saturating_sub(before) / made as u64))?
}

/// Sum of RSS and PSS (KiB) and count of the processes whose cgroup path names one of
/// `ids` (the envd init parent and server of each sandbox, plus anything else in it).
fn sandbox_process_memory(ids: &std::collections::HashSet<String>) -> (u64, u64, usize) {
    let (mut rss, mut pss, mut n) = (0, 0, 0);
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return (0, 0, 0);
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(cg) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            continue;
        };
        let in_ours = cg.lines().any(|l| {
            l.rsplit('/').next().is_some_and(|last| ids.contains(last))
                || l.split('/').any(|seg| ids.contains(seg))
        });
        if !in_ours {
            continue;
        }
        let Ok(sm) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) else {
            continue;
        };
        let kib = |k: &str| {
            sm.lines()
                .find_map(|l| l.strip_prefix(k))
                .and_then(|r| r.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        rss += kib("Rss:");
        pss += kib("Pss:");
        n += 1;
    }
    (rss, pss, n)
}

pub(super) async fn measure_density(
    cx: &Ctx,
    template: &str,
    n: usize,
    hold: Duration,
) -> anyhow::Result<Vec<Row>> {
    tokio::time::sleep(Duration::from_secs(1)).await;
    let memcg_before = empty_memcg_kib();
    let before = used_kib()?;
    let kernel_before = meminfo_fields();
    let slab_before = slab_bytes();
    let t0 = Instant::now();
    let made = Arc::new(tokio::sync::Mutex::new(Vec::<Sbx>::new()));
    let m2 = made.clone();
    let (t, internet) = (template.to_string(), cx.internet);
    let (create_samples, create_errors, msgs) = drive(&cx.api, 8, n, move |api, mut c| {
        let (t, made) = (t.clone(), m2.clone());
        async move {
            let t0 = Instant::now();
            let r = match api.create(&mut c, &t, internet).await {
                Ok(s) => {
                    made.lock().await.push(s);
                    Ok(t0.elapsed())
                }
                Err(e) => Err(e),
            };
            (c, r)
        }
    })
    .await;
    note_errors(&msgs);
    let fill = t0.elapsed();
    let sandboxes = made.lock().await.clone();
    let held = sandboxes.len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = used_kib()?;
    let kernel_after = meminfo_fields();
    let slab_after = slab_bytes();
    let ids: std::collections::HashSet<String> = sandboxes.iter().map(|s| s.id.clone()).collect();
    let (rss, pss, procs) = sandbox_process_memory(&ids);
    let memcg_at_n = empty_memcg_kib();

    // /health round trips to every sandbox, twice around, one kept-alive connection.
    // The first round also opens the router's connection to each envd; the second
    // reuses it (its pool keeps them 30 s): each round's p99 is reported too.
    let mut health = Vec::new();
    let mut health_errors = 0;
    let mut round_p99 = Vec::new();
    let mut c = cx.api.conn();
    for _ in 0..2 {
        let from = health.len();
        for s in &sandboxes {
            let t = Instant::now();
            match cx.api.health(&mut c, &s.id).await {
                Ok(()) => health.push(t.elapsed()),
                Err(e) => {
                    if health_errors == 0 {
                        eprintln!("cubicle bench: {e:#}");
                    }
                    health_errors += 1;
                }
            }
        }
        let mut round: Vec<Duration> = health[from..].to_vec();
        round.sort();
        round_p99.push(ms(pct(&round, 0.99)));
    }

    if !hold.is_zero() {
        eprintln!(
            "cubicle bench: holding {held} sandboxes for {} s",
            hold.as_secs()
        );
        tokio::time::sleep(hold).await;
    }

    // Kill them all again.
    let list = Arc::new(tokio::sync::Mutex::new(sandboxes));
    let l2 = list.clone();
    let (kill_samples, kill_errors, msgs) = drive(&cx.api, 8, held, move |api, mut c| {
        let list = l2.clone();
        async move {
            let s = list.lock().await.pop();
            let t0 = Instant::now();
            let r = match s {
                Some(s) => api.kill(&mut c, &s.id).await.map(|_| t0.elapsed()),
                None => Ok(Duration::ZERO),
            };
            (c, r)
        }
    })
    .await;
    note_errors(&msgs);

    let per = |kib: u64| {
        if held == 0 {
            0.0
        } else {
            (kib as f64 / held as f64 / 1024.0 * 1000.0).round() / 1000.0
        }
    };
    let delta = after.saturating_sub(before);
    let mem = Row {
        samples: health,
        errors: health_errors + create_errors,
        ..Row::new("density", 1)
    }
    .with("template", template)
    .with("asked", n)
    .with("held", held)
    .with("mib_per_sandbox", per(delta))
    .with("host_delta_mib", (delta as f64 / 1024.0).round())
    .with(
        "procs_per_sandbox",
        if held > 0 {
            procs as f64 / held as f64
        } else {
            0.0
        },
    )
    .with("rss_mib_per_sandbox", per(rss))
    .with("pss_mib_per_sandbox", per(pss))
    .with(
        "kernel_kib_per_sandbox",
        Value::Object(
            kernel_after
                .iter()
                .map(|(k, a)| {
                    let d = a.saturating_sub(kernel_before.get(k).copied().unwrap_or(0));
                    let per = if held > 0 { d / held as u64 } else { 0 };
                    (k.trim_end_matches(':').to_string(), json!(per))
                })
                .collect(),
        ),
    )
    .with(
        "slab_kib_per_sandbox",
        slab_growth(&slab_before, &slab_after, held, 10),
    )
    .with("empty_memcg_kib_before", memcg_before)
    .with("empty_memcg_kib_held", memcg_at_n)
    .with("fill_s", (fill.as_secs_f64() * 10.0).round() / 10.0)
    .with("health_p99_ms_by_round", round_p99)
    .with("latency_of", "GET /health");
    let creates = Row {
        samples: create_samples,
        errors: create_errors,
        ..Row::new("dens-new", 8)
    }
    .with("template", template)
    .with("latency_of", "create while filling");
    let kills = Row {
        samples: kill_samples,
        errors: kill_errors,
        ..Row::new("dens-kill", 8)
    }
    .with("template", template)
    .with("latency_of", "DELETE");
    Ok(vec![mem, creates, kills])
}
