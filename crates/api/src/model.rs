//! Response bodies, field for field as the SDKs' generated models expect them
//! (spec §2.2). Optional fields are omitted rather than sent as `null` unless the model
//! allows `null` (`domain`, `trafficAccessToken`).

use std::collections::BTreeMap;

use serde::Serialize;

/// envd version reported to SDKs. Must equal `cubicle_envd::state::ENVD_VERSION` (a
/// test checks it); duplicated so the API does not link the agent.
pub const ENVD_VERSION: &str = "0.6.13";
/// Legacy `clientID` every response carries (upstream sends this constant).
pub const CLIENT_ID: &str = "6532622b";

/// `Sandbox` (create / connect).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Sandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    #[serde(rename = "envdVersion")]
    pub envd_version: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    #[serde(rename = "envdAccessToken")]
    pub envd_access_token: String,
    #[serde(rename = "trafficAccessToken")]
    pub traffic_access_token: Option<String>,
    pub domain: Option<String>,
}

/// `lifecycle` of a detail.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    pub auto_resume: bool,
    pub on_timeout: &'static str,
}

/// `network` of a detail (`SandboxNetworkConfig`): the policy as set, without the
/// egress proxy's password and CA certificate (as upstream).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    pub allow_public_traffic: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub deny_out: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress_proxy: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rules: Option<serde_json::Value>,
    /// Cubicle's learn mode (only when on).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub learn: bool,
}

impl Network {
    /// The echo of a sandbox's policy.
    pub fn of(
        p: &cubicle_node::NetworkPolicy,
        allow_public_traffic: bool,
        mask_request_host: Option<String>,
    ) -> Self {
        let egress_proxy = p.egress_proxy.as_ref().map(|ep| {
            let mut v = serde_json::json!({ "address": ep.address });
            if let Some(u) = &ep.username {
                v["username"] = u.clone().into();
            }
            if let Some(t) = &ep.tls {
                let mut tls = serde_json::json!({ "enabled": true });
                if let Some(n) = &t.server_name {
                    tls["serverName"] = n.clone().into();
                }
                v["tls"] = tls;
            }
            v
        });
        Network {
            allow_public_traffic,
            allow_out: p.allow_out.iter().map(|d| d.to_string()).collect(),
            deny_out: p.deny_out.iter().map(|d| d.to_string()).collect(),
            dns_servers: p
                .dns_servers
                .as_ref()
                .map(|v| v.iter().map(|a| a.to_string()).collect()),
            egress_proxy,
            mask_request_host,
            rules: (!p.rules.is_empty())
                .then(|| serde_json::to_value(&p.rules).unwrap_or_default()),
            learn: p.learn,
        }
    }
}

/// `SandboxDetail` (`GET /sandboxes/{id}`).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    pub started_at: String,
    pub end_at: String,
    pub envd_version: &'static str,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    pub envd_access_token: String,
    pub allow_internet_access: bool,
    pub domain: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub network: Network,
    pub lifecycle: Lifecycle,
    /// `full` / `filesystem` once paused (left out while running or pausing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause_mode: Option<&'static str>,
    /// Sent only when true.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_unresponsive_at_pause: Option<bool>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<crate::volumes::VolumeMountBody>,
}

/// `ListedSandbox` (list items).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: &'static str,
    pub started_at: String,
    pub end_at: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: &'static str,
    pub envd_version: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    pub metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<crate::volumes::VolumeMountBody>,
    /// Sent only when true.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_unresponsive_at_pause: Option<bool>,
}

/// `SnapshotInfo` (create and list).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
}

/// One entry of a fork's answer: exactly one of `sandbox` and `error`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ForkResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Sandbox>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ForkError>,
}

/// A fork that failed.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ForkError {
    pub code: u16,
    pub message: String,
}

/// `SandboxMetric`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxMetric {
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// v1 log line.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SandboxLog {
    pub timestamp: String,
    pub line: String,
}

/// Structured log entry (v1 `logEntries`, v2 `logs`).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SandboxLogEntry {
    pub timestamp: String,
    pub message: String,
    pub level: &'static str,
    pub fields: BTreeMap<String, String>,
}

/// v1 `GET /sandboxes/{id}/logs`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxLogs {
    pub logs: Vec<SandboxLog>,
    pub log_entries: Vec<SandboxLogEntry>,
}

/// v2 `GET /v2/sandboxes/{id}/logs`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SandboxLogsV2 {
    pub logs: Vec<SandboxLogEntry>,
}

/// `GET /sandboxes/metrics`: each sandbox's latest sample.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SandboxMetrics {
    /// Sandbox id → its latest sample (sandboxes without one are left out).
    pub sandboxes: BTreeMap<String, SandboxMetric>,
}

/// `GET /cubicle/pool`: the warm pools (Cubicle's own).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct PoolCounters {
    /// Ready sandboxes per template.
    pub ready: BTreeMap<String, u64>,
    /// Pool size aimed at per template.
    pub target: BTreeMap<String, u64>,
    /// Creates served from a pool.
    pub claims: u64,
    /// Creates that found their pool empty.
    pub misses: u64,
    /// Of the misses, those served by a refill that finished while they waited for a
    /// cold create's turn (the rest were made cold).
    pub waited: u64,
    /// Sandboxes made for pools.
    pub refills: u64,
    /// Killed sandboxes whose removal (cgroups, veth, directory) is still under way in
    /// the background.
    pub teardowns: u64,
}
