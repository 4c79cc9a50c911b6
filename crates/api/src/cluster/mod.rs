//! The role split of a cluster: `cubicle node` runs a [`cubicle_node::Node`] and serves
//! the node-side API ([`node_api`]); an API replica (`cubicle serve --node URL,…`) runs
//! the control plane and the router over a [`RemoteBackend`] that calls those nodes.
//!
//! The node-side API is HTTP/1.1 under `/node/v1/` (JSON bodies), every call carrying
//! `Authorization: Bearer <token>`, a secret shared by replicas and nodes (compared in
//! constant time; a wrong or missing one is answered 401). The data plane rides on the
//! same listener: a request with the `cubicle-node-token` header
//! ([`cubicle_router::NODE_TOKEN_HEADER`]) and `E2b-Sandbox-*` routing headers is a
//! replica relaying an admitted SDK request ([`cubicle_router::Relay`]); the node's own
//! [`cubicle_router::DataPlane`] enters the sandbox.
//!
//! With the cluster's database, [`coordination`] takes the node list from the `nodes`
//! table, places creates through reservations there, routes by ownership and reports
//! the sandboxes of lost nodes (docs/cluster.md, "Leases, placement and drain"); template
//! builds are pinned to a node and relayed there ([`templates`]), and a volume lives on
//! one node, where the sandboxes that mount it are placed ([`volumes`]).
//!
//! Errors cross the wire as `{"code": <status>, "message": …, "kind": …, "subject": …}`
//! (E2B's shape plus the node error's kind), and are turned back into the same
//! [`cubicle_node::Error`] variant on the replica, so the API answers exactly what
//! `cubicle serve` would.

pub mod coordination;
pub mod journal;
mod migrate;
pub mod moving_api;
pub mod node_api;
pub mod remote;
pub mod templates;
pub mod volumes;

pub use journal::{JournalMark, StatusJournal};
pub use node_api::{NodeResolver, authenticated, node_router, node_router_with};
pub use remote::{RemoteBackend, RemoteConfig};

use serde::{Deserialize, Serialize};

/// Prefix of the node-side API's paths.
pub const PREFIX: &str = "/node/v1";

/// Checks a presented token against the expected one in constant time.
pub fn token_matches(expected: &str, given: &str) -> bool {
    let (a, b) = (expected.as_bytes(), given.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Everything a replica keeps of a node, refreshed by polling `GET /node/v1/status`
/// (`?epoch=E&since=G`: only the sandboxes changed since, see [`journal`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// The node's live sandboxes: all of them, or with `delta` those changed since the
    /// poll's `since`.
    pub sandboxes: Vec<cubicle_node::SandboxInfo>,
    /// `sandboxes` lists only changes; `removed` the ids gone since.
    #[serde(default)]
    pub delta: bool,
    #[serde(default)]
    pub removed: Vec<String>,
    /// How many sandboxes the node lists in all.
    #[serde(default)]
    pub count: usize,
    /// Where this answer stands in the node's journal (`None` from a node without one:
    /// every answer is the full list).
    #[serde(default)]
    pub journal: Option<JournalMark>,
    /// Its warm pools.
    pub pool: cubicle_node::PoolStats,
    /// Its host.
    pub host: WireHost,
    /// Most sandboxes it may hold at once (its slot range).
    pub max_sandboxes: u32,
    /// Its snapshots.
    pub snapshots: Vec<cubicle_node::SnapshotRecord>,
    /// Layer ids its sandboxes and snapshots use.
    pub layers_in_use: Vec<String>,
    /// It drains (`moving_api`): no creates, and its paused sandboxes resume elsewhere.
    #[serde(default)]
    pub draining: bool,
}

/// [`cubicle_node::host::HostStats`] on the wire (without the per-mode CPU times).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WireHost {
    pub cpus: u32,
    pub memory_total: u64,
    pub memory_available: u64,
    pub disk_total: u64,
    pub disk_available: u64,
}

impl From<&cubicle_node::host::HostStats> for WireHost {
    fn from(h: &cubicle_node::host::HostStats) -> Self {
        WireHost {
            cpus: h.cpus,
            memory_total: h.memory_total,
            memory_available: h.memory_available,
            disk_total: h.disk_total,
            disk_available: h.disk_available,
        }
    }
}

/// A node error on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireError {
    /// HTTP status.
    pub code: u16,
    /// What went wrong (the node error's text).
    pub message: String,
    /// Which [`cubicle_node::Error`] it was (see [`WireError::from_node`]).
    #[serde(default)]
    pub kind: String,
    /// The id or name the error is about, or the bare message of kinds that carry one.
    #[serde(default)]
    pub subject: String,
}

impl WireError {
    /// A node error, with the status the API would answer it with.
    pub fn from_node(e: &cubicle_node::Error) -> Self {
        use cubicle_node::Error as N;
        use cubicle_node::template::Error as T;
        if let Some(m) = crate::error::disk_full(e) {
            return WireError {
                code: 507,
                message: m.clone(),
                kind: "disk_full".into(),
                subject: m,
            };
        }
        let (code, kind, subject) = match e {
            N::SandboxNotFound(id) => (404, "sandbox_not_found", id.clone()),
            N::VolumeNotFound(id) => (404, "volume_not_found", id.clone()),
            N::SnapshotNotFound(id) => (404, "snapshot_not_found", id.clone()),
            N::Template(T::TemplateNotFound(n)) => (404, "template_not_found", n.clone()),
            N::Template(T::InvalidRequest(m)) => (400, "template_invalid", m.clone()),
            N::InvalidRequest(m) => (400, "invalid", m.clone()),
            N::Conflict(m) => (409, "conflict", m.clone()),
            N::VolumeInUse { .. } => (409, "conflict", e.to_string()),
            N::Capacity(m) => (503, "capacity", m.clone()),
            N::Unsupported(m) => (501, "unsupported", m.clone()),
            _ => (500, "runtime", e.to_string()),
        };
        WireError {
            code,
            message: e.to_string(),
            kind: kind.into(),
            subject,
        }
    }

    /// The node error it stands for (a kind this side does not know becomes `Runtime`).
    pub fn into_node(self) -> cubicle_node::Error {
        use cubicle_node::Error as N;
        use cubicle_node::template::Error as T;
        match self.kind.as_str() {
            "sandbox_not_found" => N::SandboxNotFound(self.subject),
            "volume_not_found" => N::VolumeNotFound(self.subject),
            "snapshot_not_found" => N::SnapshotNotFound(self.subject),
            "template_not_found" => N::Template(T::TemplateNotFound(self.subject)),
            "template_invalid" => N::Template(T::InvalidRequest(self.subject)),
            "invalid" => N::InvalidRequest(self.subject),
            "conflict" => N::Conflict(self.subject),
            "capacity" => N::Capacity(self.subject),
            "unsupported" => N::Unsupported(self.subject),
            "disk_full" => N::DiskFull(self.subject),
            _ => N::Runtime(self.message),
        }
    }
}

/// One result of a fork on the wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum WireResult<T> {
    Ok(T),
    Err(WireError),
}

/// `POST …/timeout`, `POST …/resume`, `POST …/fork` bodies.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WireTimeout {
    pub timeout_ms: u64,
    #[serde(default)]
    pub memory: bool,
    #[serde(default)]
    pub count: usize,
}

#[cfg(test)]
mod tests {
    use super::WireError;
    use crate::ApiError;
    use axum::http::StatusCode;

    /// A full disk on the node answers 507 through a replica too, with the node's words.
    #[test]
    fn disk_full_crosses_the_wire_as_507() {
        let e = cubicle_node::Error::io(
            "create",
            "/var/lib/cubicle/sandboxes/x/sandbox.tmp",
            std::io::Error::from_raw_os_error(libc::EDQUOT),
        );
        let local = ApiError::from(cubicle_node::Error::io(
            "create",
            "/var/lib/cubicle/sandboxes/x/sandbox.tmp",
            std::io::Error::from_raw_os_error(libc::EDQUOT),
        ));
        let w = WireError::from_node(&e);
        assert_eq!((w.code, w.kind.as_str()), (507, "disk_full"));
        let wire: WireError = serde_json::from_slice(&serde_json::to_vec(&w).unwrap()).unwrap();
        let relayed = ApiError::from(wire.into_node());
        assert_eq!(relayed.status(), StatusCode::INSUFFICIENT_STORAGE);
        assert_eq!(relayed.to_string(), local.to_string());
        // Anything else stays what it was.
        let other = WireError::from_node(&cubicle_node::Error::Runtime("boom".into()));
        assert_eq!(other.code, 500);
    }
}
