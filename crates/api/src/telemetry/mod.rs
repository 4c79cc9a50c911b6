//! What operators watch: Prometheus metrics (`GET /metrics`, OpenMetrics text) and the
//! per-request access log with request ids ([`http`]).
//!
//! Two kinds of series:
//! - counted as things happen (HTTP requests by route template and status, sandbox
//!   operations by outcome, create latency by source, the first command's latency,
//!   sandbox ends by reason, lifecycle events, template builds, webhook deliveries);
//! - read when scraped, from memory and a few small files (sandboxes by state and
//!   template, warm pools, the host's CPU, memory and disk, each live sandbox's usage as
//!   last sampled by the metrics history — a scrape never reads a sandbox's cgroup).
//!
//! Every label has a bounded set of values: routes are templates (`/sandboxes/{id}`),
//! never raw paths; sandbox ids appear only on the per-sandbox usage series, which exist
//! only while the sandbox lives.

pub mod http;

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::events::EventKind;

/// Content type of [`Telemetry::render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(&'static str, String)>;
type Hist = Family<Labels, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ])
}

fn build_histogram() -> Histogram {
    Histogram::new([
        1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
    ])
}

/// Values read at scrape time, handed in by whoever knows them (the control plane).
#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    /// Live sandboxes: (state, template) → count.
    pub sandboxes: BTreeMap<(String, String), u64>,
    /// Warm pools.
    pub pool: cubicle_node::PoolStats,
    /// The host.
    pub host: cubicle_node::host::HostStats,
    /// Each live sandbox's usage as last sampled.
    pub usage: Vec<SandboxUsage>,
    /// Webhooks registered, enabled or not.
    pub webhooks: (u64, u64),
    /// Connections the node's egress proxy relays now, when known.
    pub egress_relayed: Option<u64>,
}

/// One live sandbox's usage (from its latest metrics sample).
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxUsage {
    /// Sandbox id.
    pub id: String,
    /// Its template.
    pub template: String,
    /// CPU time used since it started, seconds.
    pub cpu_seconds: f64,
    /// Memory in use, bytes.
    pub memory_bytes: u64,
    /// Disk in use, bytes.
    pub disk_bytes: u64,
}

/// The metrics of one server.
pub struct Telemetry {
    registry: Mutex<Registry>,
    http_requests: Family<Labels, Counter>,
    http_duration: Hist,
    operations: Family<Labels, Counter>,
    create_duration: Hist,
    first_command: Hist,
    ends: Family<Labels, Counter>,
    lifecycle: Family<Labels, Counter>,
    builds: Family<Labels, Counter>,
    build_duration: Hist,
    webhook_deliveries: Family<Labels, Counter>,
    webhook_attempts: Family<Labels, Counter>,
    /// Sandboxes whose first command was measured already (forgotten when they end).
    first_seen: Mutex<HashSet<String>>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry::new()
    }
}

impl Telemetry {
    /// Registers every series (prefix `cubicle_`).
    pub fn new() -> Telemetry {
        let mut reg = Registry::with_prefix("cubicle");
        let t = Telemetry {
            registry: Mutex::new(Registry::default()),
            http_requests: Family::default(),
            http_duration: Family::new_with_constructor(latency_histogram),
            operations: Family::default(),
            create_duration: Family::new_with_constructor(latency_histogram),
            first_command: Family::new_with_constructor(latency_histogram),
            ends: Family::default(),
            lifecycle: Family::default(),
            builds: Family::default(),
            build_duration: Family::new_with_constructor(build_histogram),
            webhook_deliveries: Family::default(),
            webhook_attempts: Family::default(),
            first_seen: Mutex::new(HashSet::new()),
        };
        reg.register(
            "http_requests",
            "HTTP requests answered, by route template (REST) or data-plane target, method and status",
            t.http_requests.clone(),
        );
        reg.register(
            "http_request_duration_seconds",
            "Time to the response head, by route template and method",
            t.http_duration.clone(),
        );
        reg.register(
            "sandbox_operations",
            "Sandbox operations (create, kill, pause, resume, connect, set_timeout, refresh, snapshot, fork) by outcome (ok, client_error, unavailable, error)",
            t.operations.clone(),
        );
        reg.register(
            "sandbox_create_duration_seconds",
            "Successful creates until the sandbox was ready, by source (cold: started for the request; pool: claimed from a warm pool)",
            t.create_duration.clone(),
        );
        reg.register(
            "sandbox_first_command_duration_seconds",
            "The first command started in each sandbox (process.Process/Start through the router), until envd answered",
            t.first_command.clone(),
        );
        reg.register(
            "sandbox_ends",
            "Sandboxes that ended, by reason (killed, timeout, oom, disk_full, exited, lost)",
            t.ends.clone(),
        );
        reg.register(
            "sandbox_lifecycle_events",
            "Lifecycle events recorded (and offered to webhooks), by type",
            t.lifecycle.clone(),
        );
        reg.register(
            "template_builds",
            "Template builds by outcome (ok, error)",
            t.builds.clone(),
        );
        reg.register(
            "template_build_duration_seconds",
            "Template build time",
            t.build_duration.clone(),
        );
        reg.register(
            "webhook_deliveries",
            "Webhook deliveries by outcome (delivered, failed after every retry)",
            t.webhook_deliveries.clone(),
        );
        reg.register(
            "webhook_attempts",
            "Webhook delivery attempts by outcome (ok: 2xx; error: anything else)",
            t.webhook_attempts.clone(),
        );
        *t.registry.lock().unwrap_or_else(|p| p.into_inner()) = reg;
        t
    }

    // ---- counted as things happen ----

    /// One HTTP request answered.
    pub fn http_request(&self, route: &str, method: &str, status: u16, elapsed: Duration) {
        self.http_requests
            .get_or_create(&vec![
                ("route", route.to_string()),
                ("method", method.to_string()),
                ("status", status.to_string()),
            ])
            .inc();
        self.http_duration
            .get_or_create(&vec![
                ("route", route.to_string()),
                ("method", method.to_string()),
            ])
            .observe(elapsed.as_secs_f64());
    }

    /// One sandbox operation (see [`http::operation`]) and its HTTP status.
    pub fn operation(&self, operation: &'static str, status: u16) {
        let outcome = match status {
            200..=399 => "ok",
            503 => "unavailable",
            400..=499 => "client_error",
            _ => "error",
        };
        self.operations
            .get_or_create(&vec![
                ("operation", operation.to_string()),
                ("outcome", outcome.to_string()),
            ])
            .inc();
    }

    /// A successful create, ready after `elapsed`.
    pub fn created(&self, claimed: bool, elapsed: Duration) {
        let source = if claimed { "pool" } else { "cold" };
        self.create_duration
            .get_or_create(&vec![("source", source.to_string())])
            .observe(elapsed.as_secs_f64());
    }

    /// A command started in sandbox `id` after `elapsed`; recorded if it is the first.
    pub fn command_started(&self, id: &str, elapsed: Duration) {
        let first = self
            .first_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string());
        if first {
            self.first_command
                .get_or_create(&Vec::new())
                .observe(elapsed.as_secs_f64());
        }
    }

    /// A sandbox ended with `reason`.
    pub fn ended(&self, id: &str, reason: &str) {
        self.first_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        let reason = match reason {
            "killed" | "timeout" | "oom" | "disk_full" | "exited" | "lost" => reason,
            _ => "other",
        };
        self.ends
            .get_or_create(&vec![("reason", reason.to_string())])
            .inc();
    }

    /// A lifecycle event was recorded.
    pub fn lifecycle_event(&self, kind: EventKind) {
        self.lifecycle
            .get_or_create(&vec![("type", kind.type_name().to_string())])
            .inc();
    }

    /// A template build finished.
    pub fn template_build(&self, ok: bool, elapsed: Duration) {
        let outcome = if ok { "ok" } else { "error" };
        self.builds
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
        if ok {
            self.build_duration
                .get_or_create(&Vec::new())
                .observe(elapsed.as_secs_f64());
        }
    }

    /// A webhook delivery attempt ended.
    pub fn webhook_attempt(&self, ok: bool) {
        let outcome = if ok { "ok" } else { "error" };
        self.webhook_attempts
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
    }

    /// A webhook delivery ended (delivered, or failed after every retry).
    pub fn webhook_delivery(&self, delivered: bool) {
        let outcome = if delivered { "delivered" } else { "failed" };
        self.webhook_deliveries
            .get_or_create(&vec![("outcome", outcome.to_string())])
            .inc();
    }

    // ---- the scrape ----

    /// The OpenMetrics text of every series, with `snap` for the scrape-time ones.
    pub fn render(&self, snap: &Snapshot) -> String {
        let mut out = String::new();
        let reg = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        // The counted series, then the scrape-time ones (encoded by hand below), then
        // the `# EOF` the format ends with.
        if prometheus_client::encoding::text::encode_registry(&mut out, &reg).is_err() {
            out.clear();
        }
        drop(reg);
        let mut scrape = Registry::with_prefix("cubicle");
        register_snapshot(&mut scrape, snap);
        let _ = prometheus_client::encoding::text::encode_registry(&mut out, &scrape);
        let _ = prometheus_client::encoding::text::encode_eof(&mut out);
        out
    }
}

/// A gauge family with the given values.
fn gauges(
    values: impl IntoIterator<Item = (Labels, f64)>,
) -> Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>> {
    let f: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>> = Family::default();
    for (l, v) in values {
        f.get_or_create(&l).set(v);
    }
    f
}

/// A counter family with the given (absolute) values.
fn counters(
    values: impl IntoIterator<Item = (Labels, f64)>,
) -> Family<Labels, Counter<f64, std::sync::atomic::AtomicU64>> {
    let f: Family<Labels, Counter<f64, std::sync::atomic::AtomicU64>> = Family::default();
    for (l, v) in values {
        f.get_or_create(&l).inc_by(v);
    }
    f
}

fn register_snapshot(reg: &mut Registry, s: &Snapshot) {
    fn one(v: f64) -> Vec<(Labels, f64)> {
        vec![(Vec::new(), v)]
    }
    reg.register(
        "sandboxes",
        "Live sandboxes by state (creating, running, dying, paused) and template; pooled ones are counted in cubicle_pool_ready",
        gauges(s.sandboxes.iter().map(|((state, template), n)| {
            (
                vec![("state", state.clone()), ("template", template.clone())],
                *n as f64,
            )
        })),
    );
    reg.register(
        "pool_ready",
        "Warm-pool sandboxes ready to be claimed, by template",
        gauges(
            s.pool
                .ready
                .iter()
                .map(|(t, n)| (vec![("template", t.clone())], *n as f64)),
        ),
    );
    reg.register(
        "pool_target",
        "Warm-pool size aimed at, by template (grows on misses up to a bound)",
        gauges(
            s.pool
                .target
                .iter()
                .map(|(t, n)| (vec![("template", t.clone())], *n as f64)),
        ),
    );
    reg.register(
        "pool_claims",
        "Creates served from a warm pool (hits)",
        counters(one(s.pool.claims as f64)),
    );
    reg.register(
        "pool_misses",
        "Creates that could have used a warm pool but found it empty",
        counters(one(s.pool.misses as f64)),
    );
    reg.register(
        "pool_waited",
        "Misses served by a refill that finished while they waited (not made cold)",
        counters(one(s.pool.waited as f64)),
    );
    reg.register(
        "pool_refills",
        "Sandboxes made for warm pools",
        counters(one(s.pool.refills as f64)),
    );
    reg.register(
        "node_cpus",
        "CPUs of the host",
        gauges(one(s.host.cpus as f64)),
    );
    reg.register(
        "node_cpu_seconds",
        "CPU time of the host since boot, all CPUs, by mode",
        counters(
            s.host
                .cpu_seconds
                .iter()
                .map(|(m, v)| (vec![("mode", m.to_string())], *v)),
        ),
    );
    reg.register(
        "node_memory_total_bytes",
        "Memory of the host (MemTotal)",
        gauges(one(s.host.memory_total as f64)),
    );
    reg.register(
        "node_memory_available_bytes",
        "Memory available on the host (MemAvailable)",
        gauges(one(s.host.memory_available as f64)),
    );
    reg.register(
        "node_disk_total_bytes",
        "Size of the filesystem holding the state directory",
        gauges(one(s.host.disk_total as f64)),
    );
    reg.register(
        "node_disk_available_bytes",
        "Space left on the filesystem holding the state directory",
        gauges(one(s.host.disk_available as f64)),
    );
    let per = |f: &dyn Fn(&SandboxUsage) -> f64| {
        s.usage
            .iter()
            .map(|u| {
                (
                    vec![
                        ("sandbox_id", u.id.clone()),
                        ("template", u.template.clone()),
                    ],
                    f(u),
                )
            })
            .collect::<Vec<_>>()
    };
    reg.register(
        "sandbox_cpu_seconds",
        "CPU time each live sandbox used since it started (as last sampled, every 5 s)",
        counters(per(&|u| u.cpu_seconds)),
    );
    reg.register(
        "sandbox_memory_bytes",
        "Memory each live sandbox uses (as last sampled)",
        gauges(per(&|u| u.memory_bytes as f64)),
    );
    reg.register(
        "sandbox_disk_bytes",
        "Disk each live sandbox's writable layer uses (as last sampled)",
        gauges(per(&|u| u.disk_bytes as f64)),
    );
    if let Some(n) = s.egress_relayed {
        reg.register(
            "egress_relayed_connections",
            "Connections the egress proxy relays now (sandboxes with domain rules, learn mode or an egress proxy)",
            gauges(one(n as f64)),
        );
    }
    reg.register(
        "webhooks",
        "Webhooks registered, by enabled",
        gauges([
            (vec![("enabled", "true".to_string())], s.webhooks.0 as f64),
            (vec![("enabled", "false".to_string())], s.webhooks.1 as f64),
        ]),
    );
    reg.register(
        "build_info",
        "The running Cubicle's version",
        gauges([(
            vec![("version", env!("CARGO_PKG_VERSION").to_string())],
            1.0,
        )]),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counted_and_scraped_series() {
        let t = Telemetry::new();
        t.http_request("/sandboxes/{id}", "GET", 200, Duration::from_millis(3));
        t.operation("create", 201);
        t.operation("create", 503);
        t.created(true, Duration::from_millis(4));
        t.command_started("abc", Duration::from_millis(7));
        t.command_started("abc", Duration::from_millis(9));
        t.ended("abc", "timeout");
        t.template_build(true, Duration::from_secs(40));
        let mut snap = Snapshot::default();
        snap.sandboxes.insert(("running".into(), "base".into()), 2);
        snap.pool.ready.insert("base".into(), 3);
        snap.pool.claims = 5;
        snap.egress_relayed = Some(2);
        snap.usage.push(SandboxUsage {
            id: "abc".into(),
            template: "base".into(),
            cpu_seconds: 1.5,
            memory_bytes: 1 << 20,
            disk_bytes: 4096,
        });
        let text = t.render(&snap);
        for want in [
            r#"cubicle_http_requests_total{route="/sandboxes/{id}",method="GET",status="200"} 1"#,
            r#"cubicle_sandbox_operations_total{operation="create",outcome="ok"} 1"#,
            r#"cubicle_sandbox_operations_total{operation="create",outcome="unavailable"} 1"#,
            r#"cubicle_sandbox_create_duration_seconds_count{source="pool"} 1"#,
            "cubicle_sandbox_first_command_duration_seconds_count 1",
            r#"cubicle_sandbox_ends_total{reason="timeout"} 1"#,
            r#"cubicle_template_builds_total{outcome="ok"} 1"#,
            r#"cubicle_sandboxes{state="running",template="base"} 2"#,
            r#"cubicle_pool_ready{template="base"} 3"#,
            "cubicle_pool_claims_total 5",
            "cubicle_egress_relayed_connections 2",
            r#"cubicle_sandbox_cpu_seconds_total{sandbox_id="abc",template="base"} 1.5"#,
            "cubicle_node_cpus",
        ] {
            assert!(text.contains(want), "missing {want} in\n{text}");
        }
        assert!(text.trim_end().ends_with("# EOF"));
        assert_eq!(text.matches("# EOF").count(), 1);
        // After its end, a sandbox's next first command counts again (a new run).
        t.command_started("abc", Duration::from_millis(1));
        assert!(
            t.render(&snap)
                .contains("cubicle_sandbox_first_command_duration_seconds_count 2")
        );
    }
}
