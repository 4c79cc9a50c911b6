//! Requests parsed into typed commands: `CreateSandbox`, `SetTimeout`, `Connect`,
//! `Refresh`, the list's `ListFilter` and the create's `Idempotency`. Each `parse` takes
//! the raw body (JSON) or query and the server limits, validates everything the node
//! would otherwise trip over, and returns a command the service executes; the node never
//! sees HTTP or JSON. Unknown JSON fields are ignored (newer SDKs add fields).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use serde::de::DeserializeOwned;

use sha2::{Digest, Sha256};

use cubicle_node::NetworkPolicy;
use cubicle_node::network_policy::{EgressProxy, ProxyTls, Rule, Transform};

use crate::error::{ApiError, ApiResult};
use crate::query::{Query, decode_cursor, metadata_filter, parse_time};
use crate::templates::{self, TemplateRef};

/// Server limits the commands are validated against.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Timeout when create names none (v2; E2B's default).
    pub default_timeout: Duration,
    /// Longest timeout a request may ask for.
    pub max_timeout: Duration,
    /// Most vCPUs a create may ask for (`cpuCount`): the node's CPUs.
    pub max_cpus: u32,
    /// Most memory a create may ask for (`memoryMB`): the node's memory.
    pub max_memory_mb: u64,
    /// Largest writable layer a create may ask for (`diskSizeMB`): the node's sandbox
    /// filesystem.
    pub max_disk_mb: u64,
}

/// Least memory a create may ask for (E2B's smallest sandbox).
pub const MIN_MEMORY_MB: u64 = 128;
/// Smallest writable layer a create may ask for.
pub const MIN_DISK_MB: u64 = 64;

impl Limits {
    /// Timeouts as E2B's (300 s default, 24 h at most) and resources up to this host's
    /// CPUs and memory (disk: up to 1 TiB; `cubicle serve` sets the real size).
    pub fn for_host() -> Limits {
        Limits {
            default_timeout: Duration::from_secs(300),
            max_timeout: Duration::from_secs(24 * 3600),
            max_cpus: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            max_memory_mb: (cubicle_node::host::memory_total() >> 20).max(MIN_MEMORY_MB),
            max_disk_mb: 1 << 20,
        }
    }
}

/// A resource a create asks for, checked against `min..=max`.
fn resource(field: &str, v: Option<i64>, min: u64, max: u64, unit: &str) -> ApiResult<Option<u64>> {
    match v {
        None => Ok(None),
        Some(n) if n >= min as i64 && n as u64 <= max => Ok(Some(n as u64)),
        Some(n) => Err(ApiError::BadRequest(format!(
            "{field} must be between {min} and {max}{unit} on this node, got {n}"
        ))),
    }
}

/// Parses a JSON body; an empty body (or `null`) is `empty_is` when the body is
/// optional, else an error.
pub(crate) fn json<T: DeserializeOwned>(body: &[u8], empty_is: Option<&str>) -> ApiResult<T> {
    let empty = body.iter().all(u8::is_ascii_whitespace)
        || (empty_is.is_some() && body.trim_ascii() == b"null");
    let body: &[u8] = if empty {
        match empty_is {
            Some(default) => default.as_bytes(),
            None => {
                return Err(ApiError::BadRequest(
                    "request body must be a JSON object".into(),
                ));
            }
        }
    } else {
        body
    };
    // serde would also fill a struct from an array (`[]` with every field defaulted).
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(ApiError::BadRequest(
            "request body must be a JSON object".into(),
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid request body: {e}")))
}

/// A JSON integer, also written as a float with no fraction (`2.0` is an integer to
/// JSON Schema, and so to the OpenAPI description): for `#[serde(deserialize_with)]`.
fn int_like<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    let n = serde_json::Number::deserialize(d)?;
    if let Some(i) = n.as_i64() {
        return Ok(i);
    }
    match n.as_f64() {
        Some(f) if f.fract() == 0.0 && f >= i64::MIN as f64 && f < i64::MAX as f64 => Ok(f as i64),
        _ => Err(serde::de::Error::custom(format!(
            "expected an integer, got {n}"
        ))),
    }
}

/// [`int_like`] for optional fields (absent or `null` → `None`).
pub(crate) fn opt_int_like<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<i64>, D::Error> {
    #[derive(Deserialize)]
    struct Wrap(#[serde(deserialize_with = "int_like")] i64);
    Ok(Option::<Wrap>::deserialize(d)?.map(|w| w.0))
}

fn timeout_secs(field: &str, secs: i64, limits: &Limits, allow_zero: bool) -> ApiResult<Duration> {
    if secs < 0 || (secs == 0 && !allow_zero) {
        return Err(ApiError::BadRequest(format!(
            "{field} must be greater than 0 seconds, got {secs}"
        )));
    }
    let d = Duration::from_secs(secs as u64);
    if d > limits.max_timeout {
        let max = limits.max_timeout.as_secs();
        let human = if max.is_multiple_of(3600) {
            format!("{} hours", max / 3600)
        } else {
            format!("{max} seconds")
        };
        return Err(ApiError::BadRequest(format!(
            "Timeout cannot be greater than {human}"
        )));
    }
    Ok(d)
}

// The request bodies below carry their OpenAPI schema (`ToSchema`): keep each field's
// constraints equal to what `parse` accepts (see `crate::openapi`).

/// `autoResume` of a create.
#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = AutoResume)]
pub struct AutoResumeBody {
    /// Resume a paused sandbox on its next request.
    #[serde(default)]
    enabled: Option<bool>,
}

/// `network` of a create.
#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = SandboxNetwork)]
pub struct NetworkBody {
    /// `false`: ports other than envd's need the returned `trafficAccessToken`.
    allow_public_traffic: Option<bool>,
    #[serde(flatten)]
    egress: EgressBody,
    /// `Host` header sent to the sandbox's ports (`${PORT}` is replaced by the port).
    #[schema(schema_with = crate::openapi::mask_request_host)]
    mask_request_host: Option<String>,
    /// Ports served over HTTPS by the sandbox (not supported yet: only empty).
    #[schema(schema_with = crate::openapi::https_ports)]
    https_ports: Option<Vec<u16>>,
}

/// The egress part of `network` (create) and the whole `PUT /sandboxes/{id}/network`.
#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
struct EgressBody {
    /// Egress allow list: CIDRs, IPs or domain patterns (an allow entry beats a deny).
    #[schema(schema_with = crate::openapi::allow_out)]
    allow_out: Option<Vec<String>>,
    /// Egress deny list: CIDRs or IPs (`0.0.0.0/0`: no internet).
    #[schema(schema_with = crate::openapi::deny_out)]
    deny_out: Option<Vec<String>>,
    /// DNS servers (IPv4) the sandbox resolves through.
    #[schema(schema_with = crate::openapi::dns_servers)]
    dns_servers: Option<Vec<String>>,
    /// An egress proxy every connection goes through.
    #[schema(schema_with = crate::openapi::egress_proxy)]
    egress_proxy: Option<EgressProxyBody>,
    /// Per-domain rules (at most 10 domains, one rule each): headers the egress proxy
    /// sets on HTTP(S) requests to the domain, `${e2b.secrets.NAME}` replaced.
    #[schema(schema_with = crate::openapi::rules)]
    rules: Option<BTreeMap<String, Vec<RuleBody>>>,
    /// Cubicle's extension: learn mode (record what the policy would deny, deny nothing).
    learn: Option<bool>,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
struct EgressProxyBody {
    address: String,
    username: Option<String>,
    password: Option<String>,
    tls: Option<ProxyTlsBody>,
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
struct ProxyTlsBody {
    enabled: bool,
    server_name: Option<String>,
    ca_cert: Option<String>,
}

#[derive(Deserialize, utoipa::ToSchema)]
struct RuleBody {
    transform: Option<TransformBody>,
}

#[derive(Deserialize, utoipa::ToSchema)]
struct TransformBody {
    headers: Option<BTreeMap<String, String>>,
}

fn net_err(field: &str, msg: impl std::fmt::Display) -> ApiError {
    ApiError::BadRequest(format!("network.{field}: {msg}"))
}

impl EgressBody {
    /// The sandbox's egress policy. `allow_internet_access: false` replaces the deny
    /// list with `0.0.0.0/0` (as upstream does) and keeps the allow list.
    fn policy(self, allow_internet_access: Option<bool>) -> ApiResult<NetworkPolicy> {
        let mut p = NetworkPolicy::default();
        for s in self.allow_out.unwrap_or_default() {
            p.allow_out
                .push(s.parse().map_err(|e| net_err("allowOut", e))?);
        }
        for s in self.deny_out.unwrap_or_default() {
            p.deny_out
                .push(s.parse().map_err(|e| net_err("denyOut", e))?);
        }
        if allow_internet_access == Some(false) {
            p.deny_out = vec!["0.0.0.0/0".parse().map_err(|e| net_err("denyOut", e))?];
        }
        if let Some(servers) = self.dns_servers {
            let mut v = Vec::with_capacity(servers.len());
            for s in servers {
                v.push(
                    s.trim().parse().map_err(|_| {
                        net_err("dnsServers", format!("'{s}' is not an IPv4 address"))
                    })?,
                );
            }
            p.dns_servers = Some(v);
        }
        if let Some(ep) = self.egress_proxy {
            let tls = match ep.tls {
                Some(t) if t.enabled => Some(ProxyTls {
                    server_name: t.server_name,
                    ca_cert: t.ca_cert,
                }),
                _ => None,
            };
            if let Some(pem) = tls.as_ref().and_then(|t| t.ca_cert.as_deref()) {
                cubicle_node::check_ca_pem(pem).map_err(|e| {
                    ApiError::BadRequest(format!("Invalid egress proxy config: {e}"))
                })?;
            }
            p.egress_proxy = Some(EgressProxy {
                address: ep.address,
                username: ep.username,
                password: ep.password,
                tls,
            });
        }
        if let Some(rules) = self.rules {
            for (host, list) in rules {
                p.rules.insert(
                    host.to_ascii_lowercase(),
                    list.into_iter()
                        .map(|r| Rule {
                            transform: r.transform.map(|t| Transform {
                                headers: t.headers.unwrap_or_default(),
                            }),
                        })
                        .collect(),
                );
            }
            cubicle_node::network_policy::check_rules(&p.rules).map_err(|e| {
                let m = e.to_string();
                if m.starts_with("Network transform") {
                    ApiError::BadRequest(m)
                } else {
                    net_err("rules", m)
                }
            })?;
        }
        p.learn = self.learn.unwrap_or(false);
        p.validate().map_err(|e| match &p.egress_proxy {
            Some(_) if e.to_string().contains("proxy") => {
                ApiError::BadRequest(format!("Invalid egress proxy config: {e}"))
            }
            _ => ApiError::BadRequest(format!("network: {e}")),
        })?;
        Ok(p)
    }
}

/// A `Host` mask (`maskRequestHost`): an ASCII host, `${PORT}` allowed.
fn mask_host(s: &str) -> ApiResult<String> {
    let ok = !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._:${}".contains(&b));
    if !ok {
        return Err(net_err(
            "maskRequestHost",
            format!("'{s}' must be an ASCII host name (with ${{PORT}} for the port)"),
        ));
    }
    Ok(s.to_string())
}

/// `NewSandboxV2` (and v1 `NewSandbox`, which adds `secure`).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = NewSandbox)]
pub struct NewSandboxBody {
    /// Template: `NAME`, `NAME:default|latest` or `NAMESPACE/NAME[:TAG]`.
    #[serde(rename = "templateID")]
    #[schema(
        pattern = "^([A-Za-z0-9][A-Za-z0-9._-]*/)?[a-z0-9][a-z0-9._-]{0,63}(:[^/%]*)?$",
        example = "base"
    )]
    template_id: String,
    /// Lifetime in seconds (default 300; the legacy route: 15).
    #[schema(minimum = 1, maximum = 86400)]
    #[serde(default, deserialize_with = "opt_int_like")]
    timeout: Option<i64>,
    /// Pause instead of kill at the end.
    auto_pause: Option<bool>,
    /// Keep memory when auto-pausing. `false` (disk only) needs `autoPause` and no
    /// `autoResume`; a schema cannot say that, so it is described as `true` only.
    #[schema(schema_with = crate::openapi::true_only)]
    auto_pause_memory: Option<bool>,
    /// Resume a paused sandbox on its next request.
    auto_resume: Option<AutoResumeBody>,
    /// `false`: no internet.
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    /// v1 only; always secure here. Type-checked, otherwise ignored.
    #[serde(rename = "secure")]
    _secure: Option<bool>,
    /// Network options.
    network: Option<NetworkBody>,
    /// Your key/value pairs (filterable in the list).
    metadata: Option<BTreeMap<String, String>>,
    /// Environment variables of every process.
    #[schema(schema_with = crate::openapi::env_vars)]
    env_vars: Option<BTreeMap<String, String>>,
    /// The MCP gateway (not supported yet).
    #[schema(schema_with = crate::openapi::null_only)]
    mcp: Option<serde_json::Value>,
    /// IAM tokens (not supported yet).
    #[schema(schema_with = crate::openapi::null_only)]
    iam: Option<serde_json::Value>,
    /// Volumes to mount (`name`, `path`).
    #[schema(schema_with = crate::openapi::volume_mounts)]
    volume_mounts: Option<Vec<crate::volumes::VolumeMountRequest>>,
    /// Cubicle: vCPUs (CPU share) instead of the template's, up to the node's CPUs.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "opt_int_like")]
    cpu_count: Option<i64>,
    /// Cubicle: memory limit in MiB instead of the template's, up to the node's memory.
    #[serde(rename = "memoryMB", default, deserialize_with = "opt_int_like")]
    #[schema(minimum = 128)]
    memory_mb: Option<i64>,
    /// Cubicle: writable-layer quota in MiB instead of the template's.
    #[serde(rename = "diskSizeMB", default, deserialize_with = "opt_int_like")]
    #[schema(minimum = 64)]
    disk_size_mb: Option<i64>,
}

/// A `templateID` that is not a valid template reference (it may still name a snapshot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateError {
    /// 404 (unknown tag) rather than 400 (malformed).
    pub not_found: bool,
    /// What is wrong.
    pub message: String,
}

impl From<TemplateError> for ApiError {
    fn from(e: TemplateError) -> Self {
        if e.not_found {
            ApiError::NotFound(e.message)
        } else {
            ApiError::BadRequest(e.message)
        }
    }
}

/// Create a sandbox.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateSandbox {
    /// Which template (an error if `templateID` is no template reference: the service
    /// first looks for a snapshot of that name).
    pub template: Result<TemplateRef, TemplateError>,
    /// `templateID` as sent (percent-decoded).
    pub template_id: String,
    /// Lifetime.
    pub timeout: Duration,
    /// A network interface at all (false: loopback only).
    pub internet: bool,
    /// Egress policy.
    pub network: NetworkPolicy,
    /// `Host` for data-plane requests to the sandbox's ports.
    pub mask_request_host: Option<String>,
    /// What the request said about `allow_internet_access` (echoed by GET).
    pub allow_internet_access: Option<bool>,
    /// Issue a traffic access token (`network.allowPublicTraffic == false`).
    pub private_traffic: bool,
    /// User metadata.
    pub metadata: BTreeMap<String, String>,
    /// Environment of every process.
    pub env_vars: BTreeMap<String, String>,
    /// Pause instead of kill at the end time; resume on traffic.
    pub lifecycle: cubicle_node::Lifecycle,
    /// Volumes to mount, by name (resolved for the caller's team by the service).
    pub volume_mounts: Vec<crate::volumes::VolumeMountRequest>,
    /// vCPUs, when not the template's.
    pub cpus: Option<u32>,
    /// Memory limit in MiB, when not the template's.
    pub memory_mb: Option<u64>,
    /// Writable-layer quota in MiB, when not the template's.
    pub disk_mb: Option<u64>,
}

/// Which create route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateVersion {
    /// `POST /sandboxes` (legacy: default timeout 15 s, like its OpenAPI model).
    V1,
    /// `POST /v2/sandboxes`.
    V2,
}

/// The v1 model's default timeout.
pub const V1_DEFAULT_TIMEOUT: Duration = Duration::from_secs(15);

fn not_supported(what: &str) -> ApiError {
    ApiError::BadRequest(format!("{what} is not supported by Cubicle yet"))
}

impl CreateSandbox {
    /// Parse and validate a create body.
    pub fn parse(body: &[u8], version: CreateVersion, limits: &Limits) -> ApiResult<Self> {
        let b: NewSandboxBody = json(body, None)?;
        let template = templates::parse(&b.template_id).map_err(|e| TemplateError {
            not_found: matches!(e, ApiError::NotFound(_)),
            message: e.to_string(),
        });
        let template_id = crate::query::unescape(&b.template_id, false)
            .unwrap_or_else(|_| b.template_id.clone())
            .trim()
            .to_string();
        let timeout = match b.timeout {
            Some(t) => timeout_secs("timeout", t, limits, false)?,
            None if version == CreateVersion::V1 => V1_DEFAULT_TIMEOUT.min(limits.max_timeout),
            None => limits.default_timeout.min(limits.max_timeout),
        };
        if b.auto_pause_memory == Some(false) && b.auto_pause != Some(true) {
            return Err(ApiError::BadRequest(
                "autoPauseMemory=false requires autoPause=true".into(),
            ));
        }
        let auto_resume = b
            .auto_resume
            .as_ref()
            .is_some_and(|a| a.enabled == Some(true));
        if b.auto_pause_memory == Some(false) && auto_resume {
            return Err(ApiError::BadRequest(
                "autoResume cannot be enabled with autoPauseMemory=false (a filesystem-only pause is never resumed automatically)".into(),
            ));
        }
        let lifecycle = cubicle_node::Lifecycle {
            auto_pause: b.auto_pause == Some(true),
            auto_pause_memory: b.auto_pause_memory != Some(false),
            auto_resume,
        };
        if b.mcp.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(not_supported("The MCP gateway"));
        }
        if b.iam.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(not_supported("IAM tokens"));
        }
        let net = b.network.unwrap_or_default();
        if net.https_ports.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(not_supported("network.httpsPorts"));
        }
        let mask_request_host = net
            .mask_request_host
            .as_deref()
            .map(mask_host)
            .transpose()?;
        let network = net.egress.policy(b.allow_internet_access)?;
        let internet = network.needs_network();
        let env_vars = b.env_vars.unwrap_or_default();
        for (k, v) in &env_vars {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                return Err(ApiError::BadRequest(format!(
                    "invalid environment variable name or value: '{}'",
                    k.escape_debug()
                )));
            }
        }
        let cpus = resource("cpuCount", b.cpu_count, 1, limits.max_cpus.into(), "")?;
        let memory_mb = resource(
            "memoryMB",
            b.memory_mb,
            MIN_MEMORY_MB,
            limits.max_memory_mb,
            " MiB",
        )?;
        let disk_mb = resource(
            "diskSizeMB",
            b.disk_size_mb,
            MIN_DISK_MB,
            limits.max_disk_mb,
            " MiB",
        )?;
        Ok(CreateSandbox {
            template,
            template_id,
            timeout,
            internet,
            network,
            mask_request_host,
            allow_internet_access: b.allow_internet_access,
            private_traffic: net.allow_public_traffic == Some(false),
            metadata: b.metadata.unwrap_or_default(),
            env_vars,
            lifecycle,
            volume_mounts: b.volume_mounts.unwrap_or_default(),
            cpus: cpus.map(|c| c as u32),
            memory_mb,
            disk_mb,
        })
    }
}

/// `PUT /sandboxes/{id}/network` body (E2B's `SandboxNetworkUpdateConfig`).
#[derive(Deserialize, utoipa::ToSchema)]
#[schema(as = SandboxNetworkUpdate)]
pub struct UpdateNetworkBody {
    #[serde(flatten)]
    egress: EgressBody,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

/// `PUT /sandboxes/{id}/network`: the sandbox's whole egress policy, replaced (fields
/// left out are cleared, as upstream does).
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateNetwork {
    /// The new policy.
    pub network: NetworkPolicy,
}

impl UpdateNetwork {
    /// Parse a `SandboxNetworkUpdateConfig` body (`{}` clears the policy).
    pub fn parse(body: &[u8]) -> ApiResult<Self> {
        let b: UpdateNetworkBody = json(body, None)?;
        Ok(UpdateNetwork {
            network: b.egress.policy(b.allow_internet_access)?,
        })
    }
}

/// `POST /sandboxes/{id}/timeout` body.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct TimeoutBody {
    /// Seconds from now (0 ends the sandbox now).
    #[schema(minimum = 0, maximum = 86400)]
    #[serde(deserialize_with = "int_like")]
    timeout: i64,
}

/// `POST /sandboxes/{id}/timeout`: end := now + timeout (may shorten; 0 ends it now).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetTimeout {
    /// New lifetime from now.
    pub timeout: Duration,
}

impl SetTimeout {
    /// Parse `{"timeout": seconds}`.
    pub fn parse(body: &[u8], limits: &Limits) -> ApiResult<Self> {
        let b: TimeoutBody = json(body, None)?;
        Ok(SetTimeout {
            timeout: timeout_secs("timeout", b.timeout, limits, true)?,
        })
    }
}

/// `POST /v2/sandboxes/{id}/connect` body.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct ConnectBody {
    /// Seconds from now the sandbox lives at least (default 300).
    #[schema(minimum = 0, maximum = 86400)]
    #[serde(default, deserialize_with = "opt_int_like")]
    timeout: Option<i64>,
    /// `false`: a paused sandbox boots from its disk (its memory is dropped).
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/connect` body (legacy: `timeout` required).
#[derive(Deserialize, utoipa::ToSchema)]
pub struct ConnectBodyV1 {
    /// Seconds from now the sandbox lives at least.
    #[schema(minimum = 0, maximum = 86400)]
    #[serde(deserialize_with = "int_like")]
    timeout: i64,
    /// `false`: a paused sandbox boots from its disk (its memory is dropped).
    memory: Option<bool>,
}

/// `POST /v2/sandboxes/{id}/connect` (and v1): a running sandbox's end := max(end, now +
/// timeout); a paused one is resumed with end := now + timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    /// Lifetime from now the sandbox is guaranteed at least.
    pub timeout: Duration,
    /// Restore memory when resuming (default true).
    pub memory: bool,
}

impl Connect {
    /// Parse `{timeout?, memory?}` (v2: empty body and missing timeout mean the default;
    /// v1: `timeout` is required).
    pub fn parse(body: &[u8], version: CreateVersion, limits: &Limits) -> ApiResult<Self> {
        let (timeout, memory) = match version {
            CreateVersion::V1 => {
                let b: ConnectBodyV1 = json(body, None)?;
                (timeout_secs("timeout", b.timeout, limits, true)?, b.memory)
            }
            CreateVersion::V2 => {
                let b: ConnectBody = json(body, Some("{}"))?;
                let t = match b.timeout {
                    Some(t) => timeout_secs("timeout", t, limits, true)?,
                    None => limits.default_timeout.min(limits.max_timeout),
                };
                (t, b.memory)
            }
        };
        Ok(Connect {
            timeout,
            memory: memory != Some(false),
        })
    }
}

/// `POST /sandboxes/{id}/resume` body (optional).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResumeBody {
    /// Seconds the resumed sandbox lives (default 15).
    #[schema(minimum = 1, maximum = 86400)]
    #[serde(default, deserialize_with = "opt_int_like")]
    timeout: Option<i64>,
    /// Accepted and ignored (upstream's deprecated field).
    #[serde(rename = "autoPause")]
    _auto_pause: Option<bool>,
    /// `false`: boot from the disk (the memory is dropped).
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/resume` (deprecated; no SDK method calls it): like connect, but
/// a running sandbox is a conflict and the default timeout is 15 s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// Lifetime after the resume.
    pub timeout: Duration,
    /// Restore memory (default true).
    pub memory: bool,
}

impl Resume {
    /// Parse `{timeout?: 15, autoPause?, memory?}` (body optional).
    pub fn parse(body: &[u8], limits: &Limits) -> ApiResult<Self> {
        let b: ResumeBody = json(body, Some("{}"))?;
        let timeout = match b.timeout {
            Some(t) => timeout_secs("timeout", t, limits, false)?,
            None => V1_DEFAULT_TIMEOUT.min(limits.max_timeout),
        };
        Ok(Resume {
            timeout,
            memory: b.memory != Some(false),
        })
    }
}

/// `POST /sandboxes/{id}/pause` body (optional).
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PauseBody {
    /// `false`: keep only the disk (the processes are stopped; a resume boots over it).
    memory: Option<bool>,
    /// Refuse (503) when envd does not answer, instead of pausing anyway.
    require_healthy_guest: Option<bool>,
}

/// `POST /sandboxes/{id}/pause`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pause {
    /// Keep memory (`full`, default) or only the disk (`filesystem`).
    pub memory: bool,
    /// Refuse when envd does not answer.
    pub require_healthy_guest: bool,
}

impl Pause {
    /// Parse `{memory?, requireHealthyGuest?}` (empty or missing body accepted).
    pub fn parse(body: &[u8]) -> ApiResult<Self> {
        let b: PauseBody = json(body, Some("{}"))?;
        Ok(Pause {
            memory: b.memory != Some(false),
            require_healthy_guest: b.require_healthy_guest == Some(true),
        })
    }
}

/// `POST /sandboxes/{id}/snapshots` body (optional).
#[derive(Deserialize, utoipa::ToSchema)]
pub struct SnapshotBody {
    /// `NAME[:TAG]` (`[a-z0-9_-]`, tag `[a-z0-9_.-]`, default tag `default`; upper
    /// case is lowered, a `TEAM/` prefix naming the caller's team is accepted). Absent
    /// or blank: an unnamed snapshot.
    #[schema(pattern = "^\\s*([A-Za-z0-9_-]{1,64}(:[A-Za-z0-9_.-]{1,64})?)?\\s*$")]
    name: Option<String>,
    /// `false`: the disk only.
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateSnapshot {
    /// `name` or `name:tag` (a `namespace/` prefix must be the caller's team), if given.
    pub name: Option<(String, String)>,
    /// Include memory (default true).
    pub memory: bool,
}

fn snapshot_name_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"-_".contains(&c))
}

fn tag_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"-_.".contains(&c))
}

impl CreateSnapshot {
    /// Parse `{name?, memory?}`; `team` is the caller's team (its slug may prefix the
    /// name).
    pub fn parse(body: &[u8], team: &str) -> ApiResult<Self> {
        let b: SnapshotBody = json(body, Some("{}"))?;
        let name = match b
            .name
            .map(|n| n.trim().to_lowercase())
            .filter(|n| !n.is_empty())
        {
            None => None,
            Some(full) => {
                let rest = match full.split_once('/') {
                    Some((ns, rest)) if ns == team => rest.to_string(),
                    Some((ns, _)) => {
                        return Err(ApiError::BadRequest(format!(
                            "snapshot name '{full}': namespace '{ns}' is not your team's ('{team}')"
                        )));
                    }
                    None => full.clone(),
                };
                let (n, tag) = match rest.split_once(':') {
                    Some((n, t)) => (n.to_string(), t.to_string()),
                    None => (rest.clone(), "default".to_string()),
                };
                if !snapshot_name_ok(&n) || !tag_ok(&tag) {
                    return Err(ApiError::BadRequest(format!(
                        "invalid snapshot name '{full}': use [a-z0-9_-] for the name and [a-z0-9_.-] for the tag"
                    )));
                }
                Some((n, tag))
            }
        };
        Ok(CreateSnapshot {
            name,
            memory: b.memory != Some(false),
        })
    }
}

/// `GET /snapshots`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListSnapshots {
    /// Only snapshots of this sandbox.
    pub sandbox_id: Option<String>,
    /// Only this name (any tag) or `name:tag`, or this id.
    pub name: Option<String>,
    /// Page size (1–100).
    pub limit: usize,
    /// Continue after this snapshot (the previous page's `X-Next-Token`).
    pub next_token: Option<String>,
}

impl ListSnapshots {
    /// Parse `?sandboxID&name&limit&nextToken`.
    pub fn parse(q: &Query) -> ApiResult<Self> {
        let limit = match q.get("limit") {
            None => 100,
            Some(v) => match v.parse::<usize>() {
                Ok(n) if (1..=100).contains(&n) => n,
                _ => {
                    return Err(ApiError::BadRequest(format!(
                        "limit must be between 1 and 100, got '{v}'"
                    )));
                }
            },
        };
        Ok(ListSnapshots {
            sandbox_id: q.get("sandboxID").map(str::to_string),
            name: q.get("name").map(str::to_string),
            limit,
            next_token: q
                .get("nextToken")
                .filter(|t| !t.is_empty())
                .map(str::to_string),
        })
    }
}

/// `POST /sandboxes/{id}/fork` body (optional).
#[derive(Deserialize, utoipa::ToSchema)]
pub struct ForkBody {
    /// Seconds each fork lives (default 15).
    #[schema(minimum = 1, maximum = 86400)]
    #[serde(default, deserialize_with = "opt_int_like")]
    timeout: Option<i64>,
    /// How many forks (default 1).
    #[schema(minimum = 1, maximum = 100)]
    #[serde(default, deserialize_with = "opt_int_like")]
    count: Option<i64>,
}

/// `POST /sandboxes/{id}/fork`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fork {
    /// Lifetime of each fork (default 15 s, as upstream).
    pub timeout: Duration,
    /// How many (1–100).
    pub count: usize,
}

/// Most forks one request may ask for.
pub const MAX_FORKS: usize = 100;

impl Fork {
    /// Parse `{timeout?, count?}`.
    pub fn parse(body: &[u8], limits: &Limits) -> ApiResult<Self> {
        let b: ForkBody = json(body, Some("{}"))?;
        let timeout = match b.timeout {
            Some(t) => timeout_secs("timeout", t, limits, false)?,
            None => V1_DEFAULT_TIMEOUT.min(limits.max_timeout),
        };
        let count = match b.count {
            None => 1,
            Some(c) if (1..=MAX_FORKS as i64).contains(&c) => c as usize,
            Some(c) => {
                return Err(ApiError::BadRequest(format!(
                    "count must be between 1 and {MAX_FORKS}, got {c}"
                )));
            }
        };
        Ok(Fork { timeout, count })
    }
}

/// `POST /sandboxes/{id}/rollback` body.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RollbackBody {
    /// One of the sandbox's own snapshots: its id or a name.
    #[serde(rename = "snapshotID")]
    #[schema(pattern = "\\S")]
    snapshot_id: String,
}

/// `POST /sandboxes/{id}/rollback` (Cubicle's own): back to one of its snapshots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rollback {
    /// The snapshot (its id or one of its names).
    pub snapshot_id: String,
}

impl Rollback {
    /// Parse `{"snapshotID": "…"}`.
    pub fn parse(body: &[u8]) -> ApiResult<Self> {
        let b: RollbackBody = json(body, None)?;
        if b.snapshot_id.trim().is_empty() {
            return Err(ApiError::BadRequest("snapshotID must not be empty".into()));
        }
        Ok(Rollback {
            snapshot_id: b.snapshot_id.trim().to_string(),
        })
    }
}

/// `POST /sandboxes/{id}/refreshes` body.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct RefreshBody {
    /// Seconds from now the sandbox lives at least (default 300).
    #[schema(minimum = 0, maximum = 3600)]
    #[serde(default, deserialize_with = "opt_int_like")]
    duration: Option<i64>,
}

/// `POST /sandboxes/{id}/refreshes`: end := max(end, now + duration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refresh {
    /// Keep-alive from now.
    pub duration: Duration,
}

/// Upstream's cap on a refresh.
pub const MAX_REFRESH: Duration = Duration::from_secs(3600);

impl Refresh {
    /// Parse `{duration?}` (seconds, 0..=3600; missing → the default timeout).
    pub fn parse(body: &[u8], limits: &Limits) -> ApiResult<Self> {
        let b: RefreshBody = json(body, Some("{}"))?;
        let duration = match b.duration {
            Some(d) if !(0..=MAX_REFRESH.as_secs() as i64).contains(&d) => {
                return Err(ApiError::BadRequest(format!(
                    "duration must be between 0 and {} seconds, got {d}",
                    MAX_REFRESH.as_secs()
                )));
            }
            Some(d) => Duration::from_secs(d as u64),
            None => limits.default_timeout,
        };
        Ok(Refresh {
            duration: duration.min(limits.max_timeout),
        })
    }
}

/// Per-request idempotency facts.
#[derive(Debug, Clone)]
pub struct Idempotency {
    /// The `Idempotency-Key` header.
    pub key: String,
    /// Hash of route + canonical body.
    pub request_hash: String,
}

impl Idempotency {
    /// Validate the header and hash the request.
    pub fn new(key: &str, version: CreateVersion, body: &[u8]) -> ApiResult<Self> {
        if key.is_empty()
            || key.len() > 255
            || !key
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"-_.:".contains(&c))
        {
            return Err(ApiError::BadRequest(
                "Idempotency-Key must be 1-255 characters of [A-Za-z0-9-_.:]".into(),
            ));
        }
        // Canonical form: parsed and re-serialised (whitespace and, with serde_json's
        // default map, key order do not matter).
        let canonical = serde_json::from_slice::<serde_json::Value>(body)
            .map(|v| v.to_string())
            .unwrap_or_else(|_| String::from_utf8_lossy(body).into_owned());
        let mut h = Sha256::new();
        h.update(format!("{version:?}\n{canonical}").as_bytes());
        let request_hash = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok(Idempotency {
            key: key.to_string(),
            request_hash,
        })
    }
}

/// List filters (`GET /v2/sandboxes`).
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Include running sandboxes.
    pub running: bool,
    /// Include paused sandboxes (Cubicle has none yet).
    pub paused: bool,
    /// Every pair must match.
    pub metadata: BTreeMap<String, String>,
    /// Template id or alias.
    pub template: Option<String>,
    /// Started at or after (unix ms).
    pub started_after: Option<i64>,
    /// Newest first (default).
    pub descending: bool,
    /// Page size.
    pub limit: usize,
    /// Resume after this (started ms, id).
    pub cursor: Option<(i64, String)>,
}

impl ListFilter {
    /// From `GET /v2/sandboxes`'s query.
    pub fn v2(q: &Query) -> ApiResult<Self> {
        let (mut running, mut paused) = (true, true);
        if let Some(states) = q.get("state") {
            running = false;
            paused = false;
            for s in states.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                match s {
                    "running" => running = true,
                    "paused" => paused = true,
                    other => {
                        return Err(ApiError::BadRequest(format!(
                            "state must be running or paused, got '{other}'"
                        )));
                    }
                }
            }
        }
        let descending = match q.get("order") {
            None | Some("desc") => true,
            Some("asc") => false,
            Some(o) => {
                return Err(ApiError::BadRequest(format!(
                    "order must be asc or desc, got '{o}'"
                )));
            }
        };
        Ok(ListFilter {
            running,
            paused,
            metadata: q
                .get("metadata")
                .map(metadata_filter)
                .transpose()?
                .unwrap_or_default(),
            template: q.get("template").map(str::to_string),
            started_after: q
                .get("startedAfter")
                .map(|v| parse_time("startedAfter", v))
                .transpose()?,
            descending,
            limit: q.int("limit", 1..=100)?.unwrap_or(100) as usize,
            cursor: q.get("nextToken").map(decode_cursor).transpose()?,
        })
    }

    /// From `GET /sandboxes` (v1: running only, metadata filter, no paging).
    pub fn v1(q: &Query) -> ApiResult<Self> {
        Ok(ListFilter {
            running: true,
            metadata: q
                .get("metadata")
                .map(metadata_filter)
                .transpose()?
                .unwrap_or_default(),
            descending: true,
            limit: usize::MAX,
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            default_timeout: Duration::from_secs(300),
            max_timeout: Duration::from_secs(24 * 3600),
            max_cpus: 4,
            max_memory_mb: 8192,
            max_disk_mb: 10240,
        }
    }

    #[test]
    fn create_resources_within_the_node_or_400() {
        let parse =
            |body: &str| CreateSandbox::parse(body.as_bytes(), CreateVersion::V2, &limits());
        let c = parse(r#"{"templateID":"base"}"#).unwrap();
        assert_eq!((c.cpus, c.memory_mb, c.disk_mb), (None, None, None));
        let c = parse(r#"{"templateID":"base","cpuCount":2,"memoryMB":1024.0,"diskSizeMB":2048}"#)
            .unwrap();
        assert_eq!(
            (c.cpus, c.memory_mb, c.disk_mb),
            (Some(2), Some(1024), Some(2048))
        );
        for (body, field) in [
            (
                r#"{"templateID":"base","cpuCount":5}"#,
                "cpuCount must be between 1 and 4 on this node, got 5",
            ),
            (r#"{"templateID":"base","cpuCount":0}"#, "cpuCount"),
            (
                r#"{"templateID":"base","memoryMB":8193}"#,
                "memoryMB must be between 128 and 8192 MiB on this node",
            ),
            (r#"{"templateID":"base","memoryMB":64}"#, "memoryMB"),
            (r#"{"templateID":"base","diskSizeMB":-1}"#, "diskSizeMB"),
            (r#"{"templateID":"base","diskSizeMB":20000}"#, "diskSizeMB"),
            (
                r#"{"templateID":"base","cpuCount":"x"}"#,
                "invalid request body",
            ),
        ] {
            let e = parse(body).unwrap_err();
            assert!(matches!(e, ApiError::BadRequest(_)), "{body}: {e}");
            assert!(e.to_string().contains(field), "{body}: {e}");
        }
    }

    #[test]
    fn create_minimal_and_full() {
        let c = CreateSandbox::parse(
            br#"{"templateID":"base","metadata":{},"envVars":{}}"#,
            CreateVersion::V2,
            &limits(),
        )
        .unwrap();
        assert_eq!(c.timeout, Duration::from_secs(300));
        assert!(c.internet && !c.private_traffic);
        let c = CreateSandbox::parse(
            br#"{"templateID":"base:latest","timeout":120,"allow_internet_access":false,"network":{"allowPublicTraffic":false},"metadata":{"k":"v"},"envVars":{"A":"1"},"secure":true,"unknownField":[1,2]}"#,
            CreateVersion::V2,
            &limits(),
        )
        .unwrap();
        assert_eq!(c.template.as_ref().unwrap().name, "base");
        assert_eq!(c.timeout, Duration::from_secs(120));
        assert!(!c.internet && c.private_traffic);
        assert_eq!(c.env_vars.get("A").map(String::as_str), Some("1"));
        let v1 = CreateSandbox::parse(br#"{"templateID":"base"}"#, CreateVersion::V1, &limits())
            .unwrap();
        assert_eq!(v1.timeout, V1_DEFAULT_TIMEOUT);
        let deny = CreateSandbox::parse(
            br#"{"templateID":"base","network":{"denyOut":["0.0.0.0/0"]}}"#,
            CreateVersion::V2,
            &limits(),
        )
        .unwrap();
        assert!(!deny.internet);
        let full = CreateSandbox::parse(
            br#"{"templateID":"base","network":{"allowOut":["1.2.3.4","*.x.com"],"denyOut":["0.0.0.0/0"],"dnsServers":["9.9.9.9"],"egressProxy":{"address":"p.example:1080","username":"u","password":"pw","tls":{"enabled":true,"serverName":"p"}},"maskRequestHost":"${PORT}-h.example","rules":{"API.x.com":[{}]},"learn":true}}"#,
            CreateVersion::V2,
            &limits(),
        )
        .unwrap();
        assert!(full.internet);
        assert_eq!(full.network.allow_out.len(), 2);
        assert!(full.network.deny_all() && full.network.learn);
        assert_eq!(
            full.network.dns_servers,
            Some(vec!["9.9.9.9".parse().unwrap()])
        );
        let ep = full.network.egress_proxy.as_ref().unwrap();
        assert_eq!(
            (
                ep.address.as_str(),
                ep.tls.as_ref().unwrap().server_name.as_deref()
            ),
            ("p.example:1080", Some("p"))
        );
        assert!(full.network.rules.contains_key("api.x.com"));
        assert_eq!(full.mask_request_host.as_deref(), Some("${PORT}-h.example"));
        // allow_internet_access=false with an allow list: a network, only to it.
        let only = CreateSandbox::parse(
            br#"{"templateID":"base","allow_internet_access":false,"network":{"allowOut":["1.2.3.4"],"denyOut":["5.0.0.0/8"]}}"#,
            CreateVersion::V2,
            &limits(),
        )
        .unwrap();
        assert!(only.internet && only.network.deny_all());
        assert_eq!(only.network.deny_out.len(), 1);
    }

    #[test]
    fn update_network_replaces() {
        let u = UpdateNetwork::parse(br#"{"allowOut":["1.1.1.1"],"allow_internet_access":true}"#)
            .unwrap();
        assert_eq!(u.network.allow_out.len(), 1);
        assert!(!u.network.deny_all());
        assert!(
            UpdateNetwork::parse(b"{}")
                .unwrap()
                .network
                .is_plain_default()
        );
        assert!(UpdateNetwork::parse(b"").is_err());
        let off = UpdateNetwork::parse(br#"{"allow_internet_access":false}"#).unwrap();
        assert!(off.network.deny_all() && !off.network.needs_network());
        assert!(UpdateNetwork::parse(br#"{"allowOut":["x.com"]}"#).is_err());
        assert!(UpdateNetwork::parse(br#"{"denyOut":"x"}"#).is_err());
    }

    #[test]
    fn create_validation() {
        for (body, needle) in [
            (&br#"{"templateID":"base","timeout":0}"#[..], "greater than 0"),
            (br#"{"templateID":"base","timeout":-5}"#, "greater than 0"),
            (br#"{"templateID":"base","timeout":86401}"#, "cannot be greater than 24 hours"),
            (br#"{"templateID":"base","timeout":"10"}"#, "invalid request body"),
            (br#"{"templateID":"base","timeout":1e99}"#, "invalid request body"),
            (br#"{"templateID":"base","timeout":2.5}"#, "invalid request body"),
            (br#"{"templateID":5}"#, "invalid request body"),
            (br#"{}"#, "templateID"),
            (br#"[]"#, "JSON object"),
            (b"", "JSON object"),
            (b"not json", "JSON object"),
            (br#"{"templateID":"base""#, "invalid request body"),
            (br#"{"templateID":"base","metadata":{"a":1}}"#, "invalid request body"),
            (br#"{"templateID":"base","autoPauseMemory":false}"#, "requires autoPause"),
            (br#"{"templateID":"base","network":{"allowOut":["x.com"]}}"#, "ALL_TRAFFIC"),
            (br#"{"templateID":"base","network":{"allowOut":["a b"]}}"#, "network.allowOut"),
            (br#"{"templateID":"base","network":{"allowOut":["::1"]}}"#, "IPv6"),
            (br#"{"templateID":"base","network":{"denyOut":["x.com"]}}"#, "invalid denied CIDR x.com"),
            (br#"{"templateID":"base","network":{"dnsServers":["dns.google"]}}"#, "network.dnsServers"),
            (br#"{"templateID":"base","network":{"egressProxy":{"address":"p"}}}"#, "Invalid egress proxy config"),
            (br#"{"templateID":"base","network":{"egressProxy":{"address":"p:1","password":"x"}}}"#, "Invalid egress proxy config"),
            (br#"{"templateID":"base","network":{"egressProxy":{"address":"p:1","tls":{"enabled":true,"caCert":"junk"}}}}"#, "Invalid egress proxy config"),
            (br#"{"templateID":"base","network":{"httpsPorts":[3000]}}"#, "network.httpsPorts"),
            (br#"{"templateID":"base","network":{"maskRequestHost":"a b"}}"#, "network.maskRequestHost"),
            (br#"{"templateID":"base","network":{"rules":{"*":[{}]}}}"#, "network.rules"),
            (br#"{"templateID":"base","network":{"rules":{"a.com":[{},{}]}}}"#, "network.rules"),
            (br#"{"templateID":"base","network":{"rules":{"a.com":[{"transform":{"headers":{"A":"${e2b.secrets.k"}}}]}}}"#, "Network transform header contains a malformed E2B placeholder."),
            (br#"{"templateID":"base","network":{"rules":{"a.com":[{"transform":{"headers":{"A":"${e2b.identity.tokens.aws}"}}}]}}}"#, "identity tokens"),
            (br#"{"templateID":"base","network":{"rules":{"a.com":[{"transform":{"headers":{"Host":"x"}}}]}}}"#, "network.rules"),
            (br#"{"templateID":"base","envVars":{"A=B":"1"}}"#, "environment variable"),
            (br#"{"templateID":"base","secure":"yes"}"#, "invalid request body"),
        ] {
            let e = CreateSandbox::parse(body, CreateVersion::V2, &limits()).unwrap_err();
            assert!(
                matches!(e, ApiError::BadRequest(_)) && e.to_string().contains(needle),
                "{}: {e}",
                String::from_utf8_lossy(body)
            );
        }
        // A templateID that is no template reference may still name a snapshot: the
        // parse keeps the error for the service, which answers it if no snapshot matches.
        let c =
            CreateSandbox::parse(br#"{"templateID":""}"#, CreateVersion::V2, &limits()).unwrap();
        let e = ApiError::from(c.template.unwrap_err());
        assert!(
            matches!(e, ApiError::BadRequest(_)) && e.to_string().contains("empty"),
            "{e}"
        );
    }

    #[test]
    fn timeout_connect_refresh() {
        assert_eq!(
            SetTimeout::parse(br#"{"timeout":30}"#, &limits())
                .unwrap()
                .timeout,
            Duration::from_secs(30)
        );
        assert!(SetTimeout::parse(br#"{}"#, &limits()).is_err());
        assert!(SetTimeout::parse(b"", &limits()).is_err());
        assert!(SetTimeout::parse(br#"{"timeout":-1}"#, &limits()).is_err());
        assert!(SetTimeout::parse(br#"{"timeout":99999999}"#, &limits()).is_err());
        assert_eq!(
            Connect::parse(b"", CreateVersion::V2, &limits())
                .unwrap()
                .timeout,
            Duration::from_secs(300)
        );
        assert!(Connect::parse(br#"{}"#, CreateVersion::V1, &limits()).is_err());
        assert!(Connect::parse(br#"{"memory":"x"}"#, CreateVersion::V2, &limits()).is_err());
        assert_eq!(
            Connect::parse(
                br#"{"timeout":10,"memory":true}"#,
                CreateVersion::V1,
                &limits()
            )
            .unwrap()
            .timeout,
            Duration::from_secs(10)
        );
        assert_eq!(
            Refresh::parse(b"", &limits()).unwrap().duration,
            Duration::from_secs(300)
        );
        assert!(Refresh::parse(br#"{"duration":3601}"#, &limits()).is_err());
        assert!(
            Refresh::parse(b"[]", &limits()).is_err(),
            "an array is no body"
        );
        assert!(Refresh::parse(b"[60]", &limits()).is_err());
    }
}
