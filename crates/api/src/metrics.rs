//! Metric history: a bounded ring of samples per live sandbox, taken in the background
//! every [`STEP_MS`] (E2B's orchestrator samples every few seconds too), so that
//! `GET /sandboxes/{id}/metrics?start=…&end=…` answers with the samples inside the range
//! (unix seconds, both ends inclusive; a range that ends before the sandbox existed is
//! an empty list) and the batch route with each sandbox's latest one.
//!
//! Memory: a sample is 16 bytes (seconds, CPU % in hundredths, memory and disk in KiB —
//! memory is counted in pages, so KiB loses nothing) and a ring holds at most
//! [`CAPACITY`] of them (30 minutes at 5 s): under 6 KiB per sandbox, allocated as
//! samples arrive. Cost: a sample reads six cgroup files and the disk quota (0.4–0.9 ms
//! in a debug build on the loaded 2-core development VM; `tests/real_node.rs` prints
//! it), so at most [`BUDGET`] sandboxes are sampled per upkeep tick (one second), the
//! longest due first; with more than `BUDGET × 5` sandboxes the step stretches instead
//! of the CPU time growing.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use cubicle_node::runtime::SandboxStats;

use crate::model::SandboxMetric;
use crate::query::format_time;

/// Time between two samples of one sandbox.
pub const STEP_MS: i64 = 5_000;
/// Samples kept per sandbox (the oldest go first).
pub const CAPACITY: usize = 360;
/// Sandboxes sampled at most per upkeep tick.
pub const BUDGET: usize = 50;

/// One sample, compact.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    /// Unix seconds.
    at_s: u32,
    /// CPU use since the previous sample, in hundredths of a percent of the sandbox's CPUs.
    cpu_centipct: u16,
    /// Memory in use, KiB.
    mem_kib: u32,
    /// Disk in use, KiB (rounded up).
    disk_kib: u32,
}

/// The history of one sandbox.
#[derive(Debug)]
struct Series {
    samples: VecDeque<Sample>,
    /// CPU counter at the last sample: (unix ms, ns).
    last_cpu: (i64, u64),
    /// When the next sample is due (unix ms).
    due_ms: i64,
    cpus: u32,
    mem_total: u64,
    disk_total: u64,
}

/// What a sample needs to know about its sandbox besides the counters.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Created at (unix ms): the CPU counter was 0 then.
    pub created_at_ms: i64,
    /// vCPUs.
    pub cpus: u32,
    /// Memory limit, bytes.
    pub mem_total: u64,
    /// Disk quota, bytes (used when the stats carry no limit).
    pub disk_total: u64,
}

/// Histories of all live sandboxes.
#[derive(Debug, Default)]
pub struct MetricsHistory {
    series: Mutex<HashMap<String, Series>>,
}

fn kib(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

impl MetricsHistory {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Series>> {
        self.series.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Of `ids` (live sandboxes), those due for a sample at `now_ms` (never sampled, or
    /// their step elapsed), at most [`BUDGET`], the longest due first.
    pub fn due(&self, ids: impl IntoIterator<Item = String>, now_ms: i64) -> Vec<String> {
        let series = self.lock();
        let mut due: Vec<(i64, String)> = ids
            .into_iter()
            .filter_map(|id| {
                let at = series.get(&id).map_or(i64::MIN, |s| s.due_ms);
                (at <= now_ms).then_some((at, id))
            })
            .collect();
        if due.len() > BUDGET {
            due.select_nth_unstable_by_key(BUDGET - 1, |(at, _)| *at);
            due.truncate(BUDGET);
        }
        due.into_iter().map(|(_, id)| id).collect()
    }

    /// Records a sample of `id` taken at `now_ms`.
    pub fn record(&self, id: &str, shape: Shape, now_ms: i64, stats: &SandboxStats) {
        let mut all = self.lock();
        let s = all.entry(id.to_string()).or_insert_with(|| Series {
            samples: VecDeque::new(),
            last_cpu: (shape.created_at_ms, 0),
            due_ms: now_ms,
            cpus: shape.cpus.max(1),
            mem_total: shape.mem_total,
            disk_total: shape.disk_total,
        });
        let (t0, c0) = s.last_cpu;
        let wall_ns = ((now_ms - t0).max(1) as f64) * 1e6;
        let pct = (stats.cpu_usage_ns.saturating_sub(c0) as f64 / (wall_ns * s.cpus as f64)
            * 100.0)
            .clamp(0.0, 100.0);
        s.last_cpu = (now_ms, stats.cpu_usage_ns);
        s.due_ms = now_ms + STEP_MS;
        if let Some(limit) = stats.disk_limit_bytes {
            s.disk_total = limit;
        }
        if s.samples.len() == CAPACITY {
            s.samples.pop_front();
        }
        s.samples.push_back(Sample {
            at_s: u32::try_from(now_ms.max(0) / 1000).unwrap_or(u32::MAX),
            cpu_centipct: (pct * 100.0).round() as u16,
            mem_kib: kib(stats.memory_bytes),
            disk_kib: kib(stats.disk_used_bytes.unwrap_or(0)),
        });
    }

    /// Samples of `id` with `start_s <= time <= end_s` (unix seconds), oldest first.
    pub fn range(&self, id: &str, start_s: Option<i64>, end_s: Option<i64>) -> Vec<SandboxMetric> {
        let all = self.lock();
        let Some(s) = all.get(id) else {
            return Vec::new();
        };
        s.samples
            .iter()
            .filter(|x| in_range(x, start_s, end_s))
            .map(|x| metric(s, x))
            .collect()
    }

    /// The latest sample of `id` inside the range, if any.
    pub fn latest(
        &self,
        id: &str,
        start_s: Option<i64>,
        end_s: Option<i64>,
    ) -> Option<SandboxMetric> {
        let all = self.lock();
        let s = all.get(id)?;
        s.samples
            .iter()
            .rev()
            .find(|x| in_range(x, start_s, end_s))
            .map(|x| metric(s, x))
    }

    /// Each sandbox's usage at its latest sample: (id, CPU ns since it started, memory
    /// bytes, disk bytes). For the Prometheus scrape: no cgroup is read.
    pub fn usage(&self) -> Vec<(String, u64, u64, u64)> {
        self.lock()
            .iter()
            .filter_map(|(id, s)| {
                let x = s.samples.back()?;
                Some((
                    id.clone(),
                    s.last_cpu.1,
                    u64::from(x.mem_kib) * 1024,
                    u64::from(x.disk_kib) * 1024,
                ))
            })
            .collect()
    }

    /// Drops the history of a sandbox that ended.
    pub fn forget(&self, id: &str) {
        self.lock().remove(id);
    }

    /// Drops the histories of sandboxes not in `live` (one sampled while it was being
    /// killed would otherwise stay).
    pub fn retain(&self, live: &HashSet<String>) {
        self.lock().retain(|id, _| live.contains(id));
    }
}

fn in_range(x: &Sample, start_s: Option<i64>, end_s: Option<i64>) -> bool {
    let t = i64::from(x.at_s);
    start_s.is_none_or(|s| t >= s) && end_s.is_none_or(|e| t <= e)
}

fn metric(s: &Series, x: &Sample) -> SandboxMetric {
    let at_ms = i64::from(x.at_s) * 1000;
    SandboxMetric {
        timestamp: format_time(at_ms),
        timestamp_unix: i64::from(x.at_s),
        cpu_count: s.cpus,
        cpu_used_pct: f64::from(x.cpu_centipct) / 100.0,
        mem_used: u64::from(x.mem_kib) * 1024,
        mem_total: s.mem_total,
        mem_cache: 0,
        disk_used: u64::from(x.disk_kib) * 1024,
        disk_total: s.disk_total,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: Shape = Shape {
        created_at_ms: 1_000_000,
        cpus: 2,
        mem_total: 512 << 20,
        disk_total: 1 << 30,
    };

    fn stats(cpu_ns: u64, mem: u64) -> SandboxStats {
        SandboxStats {
            memory_bytes: mem,
            cpu_usage_ns: cpu_ns,
            disk_used_bytes: Some(5000),
            ..Default::default()
        }
    }

    #[test]
    fn samples_are_small() {
        assert_eq!(std::mem::size_of::<Sample>(), 16);
    }

    #[test]
    fn ranges_and_latest() {
        let h = MetricsHistory::default();
        // samples at 1005 s, 1010 s, 1015 s; 1 CPU-second per 5 s on 2 CPUs = 10 %
        for (i, t) in [1_005_000i64, 1_010_000, 1_015_000].iter().enumerate() {
            h.record(
                "a",
                SHAPE,
                *t,
                &stats((i as u64 + 1) * 1_000_000_000, 8 << 20),
            );
        }
        let all = h.range("a", None, None);
        assert_eq!(all.len(), 3);
        assert_eq!(all[0].timestamp_unix, 1005);
        assert_eq!(all[1].cpu_used_pct, 10.0);
        assert_eq!(all[2].mem_used, 8 << 20);
        assert_eq!(all[2].disk_used, 5120, "KiB rounded up");
        assert_eq!(all[2].mem_total, 512 << 20);
        let mid = h.range("a", Some(1006), Some(1015));
        assert_eq!(
            mid.iter().map(|m| m.timestamp_unix).collect::<Vec<_>>(),
            [1010, 1015]
        );
        assert!(
            h.range("a", Some(0), Some(1004)).is_empty(),
            "before it existed"
        );
        assert!(h.range("a", Some(1016), None).is_empty());
        assert_eq!(h.latest("a", None, None).unwrap().timestamp_unix, 1015);
        assert_eq!(
            h.latest("a", None, Some(1012)).unwrap().timestamp_unix,
            1010
        );
        assert!(h.latest("a", None, Some(1000)).is_none());
        assert!(h.range("nope", None, None).is_empty());
        h.retain(&["a".to_string()].into());
        assert_eq!(h.range("a", None, None).len(), 3);
        h.retain(&HashSet::new());
        assert!(h.range("a", None, None).is_empty());
        h.record("a", SHAPE, 1_020_000, &stats(0, 0));
        h.forget("a");
        assert!(h.range("a", None, None).is_empty());
    }

    #[test]
    fn ring_is_bounded() {
        let h = MetricsHistory::default();
        for i in 0..(CAPACITY as i64 + 10) {
            h.record("a", SHAPE, 2_000_000 + i * STEP_MS, &stats(0, 0));
        }
        let all = h.range("a", None, None);
        assert_eq!(all.len(), CAPACITY);
        assert_eq!(
            all[0].timestamp_unix,
            2_000 + 10 * 5,
            "oldest dropped first"
        );
    }

    #[test]
    fn due_respects_step_and_budget() {
        let h = MetricsHistory::default();
        let ids: Vec<String> = (0..BUDGET + 20).map(|i| format!("s{i}")).collect();
        let first = h.due(ids.clone(), 10_000);
        assert_eq!(first.len(), BUDGET);
        for id in &first {
            h.record(id, SHAPE, 10_000, &stats(0, 0));
        }
        // the 20 left over come next, the sampled ones only after a step
        let second = h.due(ids.clone(), 11_000);
        assert_eq!(second.len(), 20);
        assert!(second.iter().all(|id| !first.contains(id)));
        for id in &second {
            h.record(id, SHAPE, 11_000, &stats(0, 0));
        }
        assert!(h.due(ids.clone(), 12_000).is_empty());
        assert_eq!(h.due(ids, 10_000 + STEP_MS).len(), BUDGET);
    }
}
