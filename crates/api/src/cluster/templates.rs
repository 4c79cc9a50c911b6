//! Templates through a replica coordinated by the cluster's database (docs/cluster.md,
//! "Templates through a replica").
//!
//! A template's builds are pinned to one node: the first `POST /v3/templates` of a name
//! picks an active node (fewest sandboxes) and records name → (team, node) in the
//! database (`cluster_templates`), so every replica sends that name's builder requests —
//! file checks, uploads, start, status, cancel, tags, detail, delete — to the same node.
//! That node runs the single-host builder API itself (the same handlers,
//! `crate::template_builds`, over a control plane of its own: [`node_control_plane`]),
//! under `/node/v1/api/…` behind the node token, with the caller's team in
//! [`TEAM_HEADER`]. When a build is done the node publishes the template to the object
//! store before the build reports `ready` (`Backend::template_built`), so a create on
//! any node works: placement prefers nodes that report the template, and any other
//! node pulls its layers on first use (only the layers it lacks; a template made
//! `from_template("base")` shares base's).
//!
//! A delete is checked against the sandboxes of every node (as this replica sees
//! them), removed on the build node, then every other node drops its copy and the
//! object store its manifest, then the name is forgotten.
//!
//! Layer GC (`POST /cubicle/templates/gc`) runs on every node, each over its own layer
//! store.
//!
//! Limits: request bodies (a COPY step's archive) are buffered on the replica, up to
//! [`MAX_RELAYED_BODY`]; a template's build records, logs and tags live on its build
//! node, so while that node is lost they cannot be read (creates from the published
//! template still work).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::delete;
use bytes::Bytes;
use cubicle_node::Node;
use cubicle_node::template::BUILTINS;
use cubicle_store::{NodeState, Team, now_ms};
use serde::Deserialize;
use serde_json::{Value, json};

use super::remote::{RemoteBackend, lock};
use crate::error::{ApiError, ApiResult, read_body};
use crate::service::{ApiConfig, ControlPlane};

/// The caller's team id on a relayed builder request (the node trusts it: the node
/// token authorised the replica).
pub const TEAM_HEADER: &str = "cubicle-team";
/// The caller's team name, with [`TEAM_HEADER`].
pub const TEAM_NAME_HEADER: &str = "cubicle-team-name";
/// A volume token a replica presents to a node's content API (see `super::volumes`).
pub const VOLUME_TOKEN_HEADER: &str = "cubicle-volume-token";
/// Largest request body a replica relays (buffered): a COPY step's archive.
pub const MAX_RELAYED_BODY: usize = 2 << 30;

// ---- the node's side ----

/// The control plane a node serves the builder API with: its own template store and
/// builds (`FROM` images through `registry`), a private record store (teams come from
/// the replicas).
pub async fn node_control_plane(
    node: &Node,
    node_token: &str,
    registry: cubicle_node::template::oci::pull::RegistryOptions,
) -> ApiResult<Arc<ControlPlane>> {
    let state = node.config().state_dir.clone();
    let path = state.join("node-api.db");
    let store = tokio::task::spawn_blocking(move || cubicle_store::Store::open(&path))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    let mut config = ApiConfig::new(state.join("build-api-logs"));
    config.keyring = Arc::new(super::volumes::node_keyring(node_token));
    config.registry = registry;
    ControlPlane::open(Arc::new(node.clone()), store, config).await
}

/// The builder API and the volume content API for replicas (mounted at
/// `/node/v1/api`), `DELETE /node/v1/template-copies/{name}` (drop this node's copy of
/// a deleted template and its object-store manifest) and the node's volumes
/// (`super::volumes::node_routes`).
pub fn node_routes(cp: Arc<ControlPlane>, node: Node) -> Router {
    let (builder, _) = utoipa_axum::router::OpenApiRouter::new()
        .merge(crate::template_builds::documented_routes())
        .merge(crate::template_builds::upload_routes())
        .merge(crate::volume_content::routes())
        .split_for_parts();
    let builder = builder
        .route("/templates/{id}", delete(node_delete))
        .layer(axum::middleware::from_fn(from_replica))
        .with_state(cp.clone());
    Router::new()
        .nest("/api", builder)
        .route(
            "/template-copies/{name}",
            delete(drop_copy).with_state(node.clone()),
        )
        .merge(super::volumes::node_routes(node, cp))
}

/// The team a replica named in [`TEAM_HEADER`] (absent on uploads, which carry their
/// own permission), and the volume token in [`VOLUME_TOKEN_HEADER`] as the content
/// API expects it (`Authorization` carried the node token to the node's guard).
async fn from_replica(mut req: Request, next: Next) -> Response {
    if let Some(t) = req.headers_mut().remove(VOLUME_TOKEN_HEADER)
        && let Ok(v) = HeaderValue::from_str(&format!("Bearer {}", t.to_str().unwrap_or("")))
    {
        req.headers_mut().insert(header::AUTHORIZATION, v);
    }
    let id = req
        .headers()
        .get(TEAM_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i64>().ok());
    if let Some(id) = id {
        let name = req
            .headers()
            .get(TEAM_NAME_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        req.extensions_mut().insert(Team {
            id,
            name,
            created_at: 0,
        });
    }
    next.run(req).await
}

async fn node_delete(
    State(cp): State<Arc<ControlPlane>>,
    team: Option<axum::Extension<Team>>,
    Path(id): Path<String>,
) -> Response {
    let Some(axum::Extension(team)) = team else {
        return ApiError::Unauthorized(format!("{TEAM_HEADER} is required")).into_response();
    };
    match crate::template_builds::delete_template(&cp, &team, &id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize)]
struct DropQuery {
    #[serde(default)]
    bucket: bool,
}

/// This node's copy of a deleted template goes (unless a sandbox or snapshot here uses
/// it: 409), and with `?bucket=true` its manifest in the object store.
async fn drop_copy(
    State(node): State<Node>,
    Path(name): Path<String>,
    Query(q): Query<DropQuery>,
) -> Response {
    let r: cubicle_node::Result<Value> = async {
        if BUILTINS.contains(&name.as_str()) {
            return Err(cubicle_node::Error::InvalidRequest(format!(
                "'{name}' is a built-in template: it is not dropped"
            )));
        }
        let users = node.template_users(&name);
        if !users.is_empty() {
            return Err(cubicle_node::Error::Conflict(format!(
                "template '{name}' is used here by {}",
                users.join(", ")
            )));
        }
        let store = node.templates().clone();
        let n = name.clone();
        let present = tokio::task::spawn_blocking(move || -> cubicle_node::Result<bool> {
            if store.get(&n)?.is_none() {
                return Ok(false);
            }
            store.remove(&n)?;
            Ok(true)
        })
        .await
        .map_err(|e| cubicle_node::Error::Runtime(format!("task failed: {e}")))??;
        let unpublished = q.bucket && node.unpublish_template(&name).await?;
        Ok(json!({ "removed": present, "unpublished": unpublished }))
    }
    .await;
    super::node_api::answer(r)
}

// ---- the replica's side ----

/// Route layer of the builder routes: on a replica coordinated through the cluster's
/// database the request goes to the template's node instead of this process.
pub async fn relayed(State(cp): State<Arc<ControlPlane>>, req: Request, next: Next) -> Response {
    match cp.backend().cluster().filter(|rb| rb.is_coordinated()) {
        Some(rb) => relay(rb, req).await.unwrap_or_else(|e| e.into_response()),
        None => next.run(req).await,
    }
}

fn db_err(e: cubicle_store::Error) -> ApiError {
    match e {
        cubicle_store::Error::Conflict(m) => ApiError::Forbidden(m),
        e => ApiError::Unavailable(format!("the cluster's database: {e}")),
    }
}

async fn db<T: Send + 'static>(
    rb: &RemoteBackend,
    f: impl FnOnce(&cubicle_store::Store) -> cubicle_store::Result<T> + Send + 'static,
) -> ApiResult<T> {
    let c = rb
        .inner()
        .cluster
        .get()
        .ok_or_else(|| ApiError::Internal("not a coordinated replica".into()))?;
    c.store.call(f).await.map_err(db_err)
}

/// A builder request to the template's node.
async fn relay(rb: &RemoteBackend, req: Request) -> ApiResult<Response> {
    let team = req.extensions().get::<Team>().cloned();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let headers = forwarded_headers(req.headers(), team.as_ref());
    let body = read_body(req.into_body(), MAX_RELAYED_BODY).await?;
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let fwd = |node: String, path: String, body: Bytes| Forward {
        node,
        method: method.clone(),
        path: format!("{path}{query}"),
        headers: headers.clone(),
        body,
    };
    // The presigned upload (no API key): the node is named in the token.
    if let ["cubicle", "uploads", tok] = segs[..] {
        let (node, token) = tok
            .split_once('~')
            .ok_or_else(|| ApiError::NotFound("upload URL unknown or expired".into()))?;
        return send(
            rb,
            fwd(node.into(), format!("/cubicle/uploads/{token}"), body),
        )
        .await;
    }
    let team = team.ok_or_else(|| ApiError::Unauthorized("missing API key".into()))?;
    match (&method, &segs[..]) {
        (&Method::POST, ["v3", "templates"]) => {
            let name = body_template(&body, ["name", "alias"])?;
            let node = if BUILTINS.contains(&name.as_str()) {
                // The node refuses it (a built-in cannot be rebuilt).
                any_node(rb)?
            } else {
                build_node(rb, &team, &name).await?
            };
            send(rb, fwd(node, path.clone(), body)).await
        }
        (&Method::GET, ["templates"] | ["v2", "templates"]) => list(rb, &team, fwd).await,
        (&Method::GET, ["default-templates"]) => {
            let r = send(rb, fwd(any_node(rb)?, path.clone(), body)).await?;
            let ours: Vec<String> = db(rb, |s| s.cluster_templates(None))
                .await?
                .into_iter()
                .map(|t| t.name)
                .collect();
            filter_list(r, |n| !ours.iter().any(|o| o == n)).await
        }
        (&Method::GET, ["templates", "aliases", raw]) => {
            let name = crate::templates::parse(raw)?.name;
            let n = name.clone();
            match db(rb, move |s| s.cluster_template(&n)).await? {
                Some(t) if t.team_id == team.id => {
                    Ok(axum::Json(json!({ "templateID": name, "public": false })).into_response())
                }
                Some(_) => Err(ApiError::Forbidden(format!(
                    "template '{name}' belongs to another team"
                ))),
                None => send(rb, fwd(any_node(rb)?, path.clone(), body)).await,
            }
        }
        (&Method::POST | &Method::DELETE, ["templates", "tags"]) => {
            let name = body_template(&body, ["target", "name"])?;
            let node = node_of(rb, &team, &name).await?;
            send(rb, fwd(node, path.clone(), body)).await
        }
        (&Method::POST, ["cubicle", "templates", "gc"]) => gc_everywhere(rb, fwd).await,
        // (This layer sees every method of the builder routes' paths: one no route of
        // the path has is 405, as on a single host, not relayed or parsed.)
        (
            _,
            ["v3", "templates"]
            | ["templates"]
            | ["v2", "templates"]
            | ["default-templates"]
            | ["templates", "tags"]
            | ["templates", "aliases", _]
            | ["cubicle", "templates", "gc"],
        ) => Err(ApiError::MethodNotAllowed),
        (_, ["templates", id, rest @ ..])
        | (_, ["v2", "templates", id, rest @ ..])
        | (_, ["cubicle", "templates", id, rest @ ..]) => {
            let name = crate::templates::parse(id)?.name;
            let node = match node_of(rb, &team, &name).await {
                // A built-in's (or an imported template's) detail: any node has it.
                Err(ApiError::NotFound(_)) if rest.is_empty() && method == Method::GET => {
                    any_node(rb)?
                }
                r => r?,
            };
            let is_file_link = matches!(rest, ["files", _]);
            let r = send(rb, fwd(node.clone(), path.clone(), body)).await?;
            if is_file_link {
                return upload_url_via(r, &node).await;
            }
            Ok(r)
        }
        _ => Err(ApiError::NotFound(format!("no route {method} {path}"))),
    }
}

/// What is relayed of the client's request.
fn forwarded_headers(h: &HeaderMap, team: Option<&Team>) -> Vec<(HeaderName, String)> {
    let mut out = Vec::new();
    for k in [
        header::CONTENT_TYPE,
        header::HOST,
        HeaderName::from_static("x-forwarded-proto"),
    ] {
        if let Some(v) = h.get(&k).and_then(|v| v.to_str().ok()) {
            out.push((k, v.to_string()));
        }
    }
    if let Some(t) = team {
        out.push((HeaderName::from_static(TEAM_HEADER), t.id.to_string()));
        out.push((HeaderName::from_static(TEAM_NAME_HEADER), t.name.clone()));
    }
    out
}

struct Forward {
    node: String,
    method: Method,
    path: String,
    headers: Vec<(HeaderName, String)>,
    body: Bytes,
}

/// Sends `f` to its node's builder API; the node's answer as it is.
async fn send(rb: &RemoteBackend, f: Forward) -> ApiResult<Response> {
    let c = rb
        .inner()
        .cluster
        .get()
        .ok_or_else(|| ApiError::Internal("not a coordinated replica".into()))?;
    let i = c.link_of(rb, &f.node).ok_or_else(|| {
        ApiError::Unavailable(format!(
            "this template's builds are kept on node '{}', which has left the cluster (lost); its published template can still be used, but its builds cannot be read or changed until the node is back",
            f.node
        ))
    })?;
    let (status, ctype, bytes) = rb
        .call_raw(i, f.method, &format!("/api{}", f.path), &f.headers, f.body)
        .await
        .map_err(|e| {
            ApiError::Unavailable(format!(
                "node '{}' (which keeps this template's builds): {e}",
                f.node
            ))
        })?;
    let mut resp = Response::new(Body::from(bytes));
    *resp.status_mut() = status;
    if let Some(ct) = ctype.and_then(|c| HeaderValue::from_str(&c).ok()) {
        resp.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    Ok(resp)
}

async fn json_of(r: Response) -> ApiResult<(StatusCode, Value)> {
    let status = r.status();
    let b = read_body(r.into_body(), 64 << 20).await?;
    let v = serde_json::from_slice(&b).unwrap_or(Value::Null);
    Ok((status, v))
}

/// A node's list answer, keeping the entries whose `templateID` passes `keep`.
async fn filter_list(r: Response, keep: impl Fn(&str) -> bool) -> ApiResult<Response> {
    let (status, v) = json_of(r).await?;
    if !status.is_success() {
        return Ok((status, axum::Json(v)).into_response());
    }
    let out: Vec<Value> = v
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|t| {
            t.get("templateID")
                .and_then(Value::as_str)
                .is_some_and(&keep)
        })
        .collect();
    Ok(axum::Json(out).into_response())
}

/// The team's templates: each build node's list, kept to the names the database
/// gives the team.
async fn list(
    rb: &RemoteBackend,
    team: &Team,
    fwd: impl Fn(String, String, Bytes) -> Forward,
) -> ApiResult<Response> {
    let tid = team.id;
    let rows = db(rb, move |s| s.cluster_templates(Some(tid))).await?;
    let mut by_node: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for t in rows {
        by_node.entry(t.node_id).or_default().push(t.name);
    }
    let mut out = Vec::new();
    for (node, names) in by_node {
        match send(rb, fwd(node.clone(), "/templates".into(), Bytes::new())).await {
            Ok(r) => {
                let (_, v) = json_of(r).await?;
                out.extend(
                    v.as_array()
                        .cloned()
                        .unwrap_or_default()
                        .into_iter()
                        .filter(|t| {
                            t.get("templateID")
                                .and_then(Value::as_str)
                                .is_some_and(|n| names.iter().any(|x| x == n))
                        }),
                );
            }
            Err(e) => tracing::warn!(node = %node, "listing its templates: {e}"),
        }
    }
    Ok(axum::Json(out).into_response())
}

/// `POST /cubicle/templates/gc` on a coordinated replica: every node collects its own
/// layer store (what its sandboxes, snapshots and recent builds use stays), and the
/// answer sums theirs (`removed`, `freedBytes`, `kept`), with each node's in `nodes`.
/// A node that fails is named there with its error; 503 when none answered.
async fn gc_everywhere(
    rb: &RemoteBackend,
    fwd: impl Fn(String, String, Bytes) -> Forward,
) -> ApiResult<Response> {
    let names: Vec<String> = rb
        .links()
        .iter()
        .filter(|l| !l.retired() && lock(&l.down).is_none())
        .filter_map(|l| l.name.clone())
        .collect();
    let (mut removed, mut freed, mut kept) = (serde_json::Map::new(), 0u64, 0u64);
    let (mut nodes, mut answered) = (serde_json::Map::new(), 0);
    for node in names {
        let r = send(
            rb,
            fwd(node.clone(), "/cubicle/templates/gc".into(), Bytes::new()),
        )
        .await;
        let (status, v) = match r {
            Ok(r) => json_of(r).await?,
            Err(e) => {
                nodes.insert(node, json!({ "error": e.to_string() }));
                continue;
            }
        };
        if !status.is_success() {
            let msg = v.get("message").and_then(Value::as_str).unwrap_or("failed");
            nodes.insert(node, json!({ "error": format!("{status}: {msg}") }));
            continue;
        }
        answered += 1;
        if let Some(m) = v.get("removed").and_then(Value::as_object) {
            removed.extend(m.clone());
        }
        freed += v.get("freedBytes").and_then(Value::as_u64).unwrap_or(0);
        kept += v.get("kept").and_then(Value::as_u64).unwrap_or(0);
        nodes.insert(node, v);
    }
    if answered == 0 {
        return Err(ApiError::Unavailable(format!(
            "no node could collect its layers: {}",
            Value::Object(nodes)
        )));
    }
    Ok(axum::Json(json!({
        "removed": removed, "freedBytes": freed, "kept": kept, "nodes": nodes,
    }))
    .into_response())
}

/// The node of the team's template `name` (404 when it is unknown or another team's).
async fn node_of(rb: &RemoteBackend, team: &Team, name: &str) -> ApiResult<String> {
    let n = name.to_string();
    match db(rb, move |s| s.cluster_template(&n)).await? {
        Some(t) if t.team_id == team.id => Ok(t.node_id),
        _ => Err(ApiError::NotFound(format!("template '{name}' not found"))),
    }
}

/// The node template `name` is built on: the one recorded, or a new record on the
/// active node with the fewest sandboxes (another team's name: 403).
async fn build_node(rb: &RemoteBackend, team: &Team, name: &str) -> ApiResult<String> {
    let n = name.to_string();
    if let Some(t) = db(rb, move |s| s.cluster_template(&n)).await? {
        if t.team_id != team.id {
            return Err(ApiError::Forbidden(format!(
                "template name '{name}' belongs to another team"
            )));
        }
        return Ok(t.node_id);
    }
    let now = now_ms();
    let links = rb.links();
    let down = |id: &str| {
        links
            .iter()
            .find(|l| l.name.as_deref() == Some(id))
            .is_none_or(|l| l.retired() || lock(&l.down).is_some())
    };
    let pick = rb
        .cluster_nodes()
        .into_iter()
        .filter(|n| n.state == NodeState::Active && n.lease_expires_at > now && !down(&n.id))
        .min_by_key(|n| (n.sandboxes, n.id.clone()))
        .ok_or_else(|| ApiError::Unavailable("no active node can build templates now".into()))?;
    let (n, tid, node) = (name.to_string(), team.id, pick.id.clone());
    let t = db(rb, move |s| s.claim_cluster_template(&n, tid, &node, now)).await?;
    tracing::info!(template = %name, node = %t.node_id, team = %team.name,
        "template builds pinned to node {} (active, fewest sandboxes: {})", t.node_id, pick.sandboxes);
    Ok(t.node_id)
}

/// Any node that answers (built-ins and imported templates are on every node).
fn any_node(rb: &RemoteBackend) -> ApiResult<String> {
    rb.links()
        .iter()
        .filter(|l| !l.retired() && lock(&l.down).is_none())
        .find_map(|l| l.name.clone())
        .ok_or_else(|| ApiError::Unavailable("no node of the cluster answers".into()))
}

/// The file check's upload URL, made to name the node (`…/cubicle/uploads/NODE~TOKEN`)
/// so that whichever replica receives the upload relays it there.
async fn upload_url_via(r: Response, node: &str) -> ApiResult<Response> {
    let (status, mut v) = json_of(r).await?;
    if let Some(url) = v.get("url").and_then(Value::as_str) {
        let u = url.replacen("/cubicle/uploads/", &format!("/cubicle/uploads/{node}~"), 1);
        v["url"] = json!(u);
    }
    Ok((status, axum::Json(v)).into_response())
}

/// `DELETE /templates/{name}` on a coordinated replica: refused while a sandbox on any
/// node uses it; removed on its build node, then every node's copy and the object
/// store's manifest, then the name.
pub async fn delete_everywhere(
    rb: &RemoteBackend,
    cp: &Arc<ControlPlane>,
    team: &Team,
    name: &str,
) -> ApiResult<()> {
    let node = node_of(rb, team, name).await.map_err(|_| {
        ApiError::NotFound(format!(
            "template '{name}' not found (built-ins cannot be removed through the API)"
        ))
    })?;
    let users = cp.backend().sandboxes_of(name);
    if !users.is_empty() {
        return Err(ApiError::BadRequest(format!(
            "template '{name}' is used by {} sandbox(es) or snapshot(s) ({}); kill them (or delete the snapshots) first",
            users.len(),
            users.join(", ")
        )));
    }
    let f = Forward {
        node: node.clone(),
        method: Method::DELETE,
        path: format!("/templates/{name}"),
        headers: forwarded_headers(&HeaderMap::new(), Some(team)),
        body: Bytes::new(),
    };
    match send(rb, f).await {
        Ok(r) if r.status().is_success() || r.status() == StatusCode::NOT_FOUND => {}
        Ok(r) => {
            let (status, v) = json_of(r).await?;
            let msg = v
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("the node refused")
                .to_string();
            return Err(match status {
                StatusCode::BAD_REQUEST => ApiError::BadRequest(msg),
                StatusCode::CONFLICT => ApiError::Conflict(msg),
                _ => ApiError::Unavailable(format!("node '{node}': {msg}")),
            });
        }
        // The build node is gone: its copy goes with it; the others' and the bucket's
        // copies still go.
        Err(e) => tracing::warn!(template = %name, node = %node, "deleting on the build node: {e}"),
    }
    let mut bucket_done = false;
    for (i, link) in rb.links().iter().enumerate() {
        if link.retired() || link.name.is_none() {
            continue;
        }
        let path = format!("/template-copies/{name}?bucket={}", !bucket_done);
        match rb
            .call_raw(i, Method::DELETE, &path, &[], Bytes::new())
            .await
        {
            Ok((s, _, _)) if s.is_success() => bucket_done = true,
            Ok((s, _, b)) => tracing::warn!(template = %name, node = ?link.name,
                "dropping the node's copy: {s} {}", String::from_utf8_lossy(&b)),
            Err(e) => {
                tracing::warn!(template = %name, node = ?link.name, "dropping the node's copy: {e}")
            }
        }
    }
    if !bucket_done {
        tracing::warn!(template = %name, "no node removed the template from the object store");
    }
    let n = name.to_string();
    db(rb, move |s| s.delete_cluster_template(&n)).await?;
    tracing::info!(template = %name, team = %team.name, node = %node, "template removed from the cluster");
    Ok(())
}

/// The owner team of a template built through the replicas (`None`: a built-in, an
/// imported one, or unknown). Reads the database (not for built-ins).
pub(super) fn owner(rb: &RemoteBackend, name: &str) -> Option<String> {
    if BUILTINS.contains(&name) {
        return None;
    }
    let c = rb.inner().cluster.get()?;
    let n = name.to_string();
    c.store
        .read(move |s| s.cluster_template(&n))
        .ok()
        .flatten()
        .map(|t| t.team_id.to_string())
}

/// The build node of `template` when it names a tag (`name:tag`, not the default one)
/// of a template built through the replicas: only a template's default build is
/// published to the object store, its tags stay on its build node, so a create of one
/// must go there (elsewhere it is "not found"). Reads the database.
pub(super) fn tag_node(rb: &RemoteBackend, template: &str) -> Option<String> {
    let r = crate::templates::parse(template).ok()?;
    r.tag.as_ref()?;
    if BUILTINS.contains(&r.name.as_str()) {
        return None;
    }
    let c = rb.inner().cluster.get()?;
    c.store
        .read(move |s| s.cluster_template(&r.name))
        .ok()
        .flatten()
        .map(|t| t.node_id)
}

/// Whether the database names template `name` (built through a replica; its layers
/// are in the object store once its build is done).
pub(super) fn recorded(rb: &RemoteBackend, name: &str) -> bool {
    if BUILTINS.contains(&name) {
        return false;
    }
    let Some(c) = rb.inner().cluster.get() else {
        return false;
    };
    let n = name.to_string();
    c.store
        .read(move |s| s.cluster_template(&n))
        .ok()
        .flatten()
        .is_some()
}

/// The template a JSON request body names, for choosing the node to relay it to: the
/// first of `keys` present, lower-cased and parsed as `name[:tag]`, without the tag.
/// (The node that gets the body checks it again, and answers as it would alone.)
fn body_template(body: &[u8], keys: [&str; 2]) -> ApiResult<String> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))?;
    let raw = keys
        .iter()
        .find_map(|k| v.get(*k).and_then(Value::as_str))
        .ok_or_else(|| ApiError::BadRequest(format!("{} is required", keys[0])))?
        .to_ascii_lowercase();
    Ok(crate::templates::parse(&raw)?.name)
}
