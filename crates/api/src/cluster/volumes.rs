//! Volumes through a replica coordinated by the cluster's database (docs/cluster.md,
//! "Volumes through a replica").
//!
//! A volume lives on one node: its directory is on that node's disk (quota and all, as
//! on a single host), and the database records which node (`volumes.node_id`). The
//! replica that creates it picks the active node with the fewest sandboxes; a sandbox
//! that mounts it is placed on that node (`ClusterDb::create`); the content API
//! (`/volumecontent/…`), usage and delete go to that node. While the node is draining,
//! creates that mount the volume are refused (the drain would have to move the data);
//! while it is lost, everything about the volume answers 503 naming the node. The data
//! never moves (no copy in the object store): a volume is as durable as its node's disk.
//!
//! Node side: `POST|DELETE /node/v1/volumes/{id}`, `GET /node/v1/volumes/{id}/usage`,
//! and the content API at `/node/v1/api/volumecontent/…` (the single-host handlers over
//! the node's own control plane, which records the volumes it holds). The volume token
//! the SDK presents is checked on the replica (its key); the replica then presents the
//! token the node's key gives (both derive it from the node token: [`node_keyring`]).

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use cubicle_node::Node;
use cubicle_store::{NodeState, now_ms};
use serde::{Deserialize, Serialize};
use sha2::Digest;

use super::remote::{RemoteBackend, lock};
use crate::error::read_body;
use crate::service::ControlPlane;

/// The team a node's own control plane files the volumes it holds under.
const NODE_TEAM: &str = "cluster-volumes";

/// The key of a node's own control plane: derived from the node token, so replicas can
/// present the volume tokens it accepts.
pub fn node_keyring(node_token: &str) -> crate::keyring::Keyring {
    let mut h = sha2::Sha256::new();
    h.update(b"cubicle node volume key v1\0");
    h.update(node_token.as_bytes());
    let master: [u8; 32] = h.finalize().into();
    crate::keyring::Keyring::from_master(&master)
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewVolume {
    size_mb: u64,
}

#[derive(Clone)]
struct NodeVolumes {
    node: Node,
    cp: Arc<ControlPlane>,
}

/// `POST|DELETE /volumes/{id}`, `GET /volumes/{id}/usage` of the node-side API.
pub fn node_routes(node: Node, cp: Arc<ControlPlane>) -> Router {
    Router::new()
        .route("/volumes/{id}", post(create).delete(remove))
        .route("/volumes/{id}/usage", get(usage))
        .with_state(NodeVolumes { node, cp })
}

async fn create(
    State(st): State<NodeVolumes>,
    Path(id): Path<String>,
    Json(b): Json<NewVolume>,
) -> Response {
    let r: cubicle_node::Result<()> = async {
        st.node.create_volume(&id, b.size_mb).await?;
        // The node's own record (its content API checks it; a restart re-makes a lost
        // directory from it).
        let (i, size) = (id.clone(), b.size_mb);
        st.cp
            .store()
            .call(move |s| {
                let team = s.ensure_team(NODE_TEAM)?;
                s.insert_volume(&cubicle_store::VolumeRow {
                    id: i.clone(),
                    team_id: team.id,
                    name: i,
                    size_mb: size,
                    created_at: now_ms(),
                })
            })
            .await
            .map_err(|e| cubicle_node::Error::Runtime(format!("recording the volume: {e}")))?;
        Ok(())
    }
    .await;
    match r {
        Ok(()) => StatusCode::CREATED.into_response(),
        Err(e) => super::node_api::fail(e),
    }
}

async fn remove(State(st): State<NodeVolumes>, Path(id): Path<String>) -> Response {
    if let Err(e) = st.node.delete_volume(&id).await {
        return super::node_api::fail(e);
    }
    let i = id.clone();
    if let Err(e) = st.cp.store().call(move |s| s.delete_volume(&i)).await {
        tracing::warn!(volume = %id, "forgetting the volume's record: {e}");
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn usage(State(st): State<NodeVolumes>, Path(id): Path<String>) -> Response {
    let node = st.node.clone();
    super::node_api::answer(
        tokio::task::spawn_blocking(move || node.volume_usage(&id))
            .await
            .unwrap_or_else(|e| Err(cubicle_node::Error::Runtime(format!("task failed: {e}")))),
    )
}

// ---- the replica's side ----

fn db(rb: &RemoteBackend) -> cubicle_node::Result<&Arc<super::coordination::ClusterDb>> {
    rb.inner().cluster.get().ok_or_else(|| {
        cubicle_node::Error::Unsupported(
            "volumes need a replica coordinated through the cluster's database (--database, no --node)".into(),
        )
    })
}

fn db_err(e: cubicle_store::Error) -> cubicle_node::Error {
    cubicle_node::Error::Runtime(format!("the cluster's database: {e}"))
}

/// Why the nodes a volume lives on cannot serve it now (`None`: it can).
fn unavailable(rb: &RemoteBackend, volume: &str, node: &str) -> Option<String> {
    let row = rb.cluster_nodes().into_iter().find(|n| n.id == node);
    match row {
        None => Some(format!(
            "volume '{volume}' lives on node '{node}', which is not in the cluster any more; its data is there"
        )),
        Some(n) if n.state == NodeState::Lost => Some(format!(
            "volume '{volume}' lives on node '{node}', which is lost (its lease ran out); its data is unreachable until the node is back"
        )),
        _ => None,
    }
}

/// The node volume `id` lives on, and its link (503-shaped errors when it is gone).
pub(super) fn node_of(rb: &RemoteBackend, id: &str) -> cubicle_node::Result<(String, usize)> {
    let c = db(rb)?;
    let v = id.to_string();
    let node = c
        .store
        .read(move |s| s.volume_node(&v))
        .map_err(db_err)?
        .ok_or_else(|| cubicle_node::Error::VolumeNotFound(id.to_string()))?;
    if let Some(why) = unavailable(rb, id, &node) {
        return Err(cubicle_node::Error::Capacity(why));
    }
    let i = c.link_of(rb, &node).ok_or_else(|| {
        cubicle_node::Error::Capacity(format!(
            "volume '{id}' lives on node '{node}', which has left the cluster"
        ))
    })?;
    Ok((node, i))
}

/// The node every volume of a create lives on (they must share one), checked to take
/// sandboxes: not draining, not lost. `None`: the create mounts no volume.
pub(super) fn pinned_node(
    rb: &RemoteBackend,
    req: &cubicle_node::CreateRequest,
) -> cubicle_node::Result<Option<String>> {
    let mut pinned: Option<(String, String)> = None;
    for m in &req.volumes {
        let (node, _) = node_of(rb, &m.volume_id)?;
        match &pinned {
            Some((n, v)) if *n != node => {
                return Err(cubicle_node::Error::InvalidRequest(format!(
                    "volumes '{v}' and '{}' live on different nodes ({n}, {node}); a sandbox can mount volumes of one node only",
                    m.volume_id
                )));
            }
            _ => pinned = Some((node, m.volume_id.clone())),
        }
    }
    let Some((node, volume)) = pinned else {
        return Ok(None);
    };
    if rb
        .cluster_nodes()
        .iter()
        .any(|n| n.id == node && n.state == NodeState::Draining)
    {
        return Err(cubicle_node::Error::Capacity(format!(
            "volume '{volume}' lives on node '{node}', which is draining: sandboxes that mount it cannot be made until the drain ends (`cubicle node drain {node} --cancel`)"
        )));
    }
    Ok(Some(node))
}

/// `Backend::create_volume` of a coordinated replica: on the active node with the
/// fewest sandboxes, recorded in the database.
pub(super) async fn create_volume(
    rb: &RemoteBackend,
    id: &str,
    size_mb: u64,
) -> cubicle_node::Result<()> {
    let c = db(rb)?;
    let now = now_ms();
    let links = rb.links();
    let answering = |name: &str| {
        links
            .iter()
            .any(|l| l.name.as_deref() == Some(name) && !l.retired() && lock(&l.down).is_none())
    };
    let node = rb
        .cluster_nodes()
        .into_iter()
        .filter(|n| n.state == NodeState::Active && n.lease_expires_at > now && answering(&n.id))
        .min_by_key(|n| (n.sandboxes, n.id.clone()))
        .ok_or_else(|| {
            cubicle_node::Error::Capacity("no active node can hold a volume now".into())
        })?;
    let i = c.link_of(rb, &node.id).ok_or_else(|| {
        cubicle_node::Error::Capacity(format!("node '{}' left the cluster", node.id))
    })?;
    let (v, n) = (id.to_string(), node.id.clone());
    c.store
        .call(move |s| s.set_volume_node(&v, &n))
        .await
        .map_err(db_err)?;
    let body = serde_json::to_vec(&NewVolume { size_mb }).unwrap_or_default();
    let (status, _, b) = rb
        .call_raw(
            i,
            Method::POST,
            &format!("/volumes/{id}"),
            &[(header::CONTENT_TYPE, "application/json".into())],
            Bytes::from(body),
        )
        .await?;
    if !status.is_success() {
        return Err(wire_error(status, &b));
    }
    tracing::info!(volume = %id, node = %node.id, "volume placed on node {} (active, fewest sandboxes: {})", node.id, node.sandboxes);
    Ok(())
}

fn wire_error(status: StatusCode, b: &[u8]) -> cubicle_node::Error {
    match serde_json::from_slice::<super::WireError>(b) {
        Ok(w) => w.into_node(),
        Err(_) => cubicle_node::Error::Runtime(format!(
            "node answered {status}: {}",
            String::from_utf8_lossy(&b[..b.len().min(300)])
        )),
    }
}

/// `Backend::delete_volume` of a coordinated replica: on its node.
pub(super) async fn delete_volume(rb: &RemoteBackend, id: &str) -> cubicle_node::Result<()> {
    let (_, i) = match node_of(rb, id) {
        // Never placed (its create failed before): nothing on any disk.
        Err(cubicle_node::Error::VolumeNotFound(_)) => return Ok(()),
        r => r?,
    };
    let (status, _, b) = rb
        .call_raw(
            i,
            Method::DELETE,
            &format!("/volumes/{id}"),
            &[],
            Bytes::new(),
        )
        .await?;
    if !status.is_success() {
        return Err(wire_error(status, &b));
    }
    Ok(())
}

/// `Backend::volume_usage` of a coordinated replica (blocking).
pub(super) fn volume_usage(rb: &RemoteBackend, id: &str) -> cubicle_node::Result<(u64, u64)> {
    let (_, i) = node_of(rb, id)?;
    rb.block(async {
        let (status, _, b) = rb
            .call_raw(
                i,
                Method::GET,
                &format!("/volumes/{id}/usage"),
                &[],
                Bytes::new(),
            )
            .await?;
        if !status.is_success() {
            return Err(wire_error(status, &b));
        }
        serde_json::from_slice(&b)
            .map_err(|e| cubicle_node::Error::Runtime(format!("volume usage: {e}")))
    })
}

/// Route layer of the volume content API: on a coordinated replica the request is
/// authorised here (the volume's token, with this replica's key) and relayed to the
/// volume's node with the token that node's key gives.
pub async fn relayed(State(cp): State<Arc<ControlPlane>>, req: Request, next: Next) -> Response {
    let Some(rb) = cp.backend().cluster().filter(|rb| rb.is_coordinated()) else {
        return next.run(req).await;
    };
    let path = req.uri().path().to_string();
    let id = path
        .strip_prefix("/volumecontent/")
        .and_then(|p| p.split('/').next())
        .unwrap_or_default()
        .to_string();
    if let Err(e) = crate::volume_content::authorize(&cp, &id, req.headers()) {
        return e.into_response();
    }
    let content_error = |status: StatusCode, m: String| {
        crate::volume_content::ContentError::new(status, m).into_response()
    };
    let (_, i) = match node_of(rb, &id) {
        Ok(x) => x,
        Err(cubicle_node::Error::VolumeNotFound(_)) => {
            return content_error(StatusCode::NOT_FOUND, format!("volume '{id}' not found"));
        }
        Err(e) => return content_error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    let token = node_keyring(rb.token()).volume_token(&id);
    let method = req.method().clone();
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let mut headers = vec![(
        axum::http::HeaderName::from_static(super::templates::VOLUME_TOKEN_HEADER),
        token,
    )];
    if let Some(ct) = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    {
        headers.push((header::CONTENT_TYPE, ct.to_string()));
    }
    let body = match read_body(req.into_body(), super::templates::MAX_RELAYED_BODY).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match rb
        .call_raw(i, method, &format!("/api{path}{query}"), &headers, body)
        .await
    {
        Ok((status, ctype, bytes)) => {
            let mut resp = Response::new(axum::body::Body::from(bytes));
            *resp.status_mut() = status;
            if let Some(ct) = ctype.and_then(|c| HeaderValue::from_str(&c).ok()) {
                resp.headers_mut().insert(header::CONTENT_TYPE, ct);
            }
            resp
        }
        Err(e) => content_error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}
