//! The node-side API `cubicle node` serves (see [`super`]): the operations of the
//! [`Backend`] trait over HTTP for the replicas, and the node's end of the data plane
//! (the node's own [`DataPlane`] over a [`NodeResolver`], reached by relayed requests).

use std::sync::Arc;
use std::time::Duration;

use axum::{
    Json, Router,
    extract::{Path, Query, Request, State},
    http::{StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
    routing::{delete, get, post},
};
use cubicle_node::{
    CreateRequest, NetworkPolicy, Node, PauseRequest, SandboxState, SnapshotRequest,
};
use cubicle_router::{DataPlane, NODE_TOKEN_HEADER, SandboxResolver, SandboxTarget};
use serde::Deserialize;

use super::{
    JournalMark, NodeStatus, StatusJournal, WireError, WireHost, WireResult, WireTimeout,
    token_matches,
};
use crate::backend::Backend;

/// The node's sandboxes as its own data plane sees them: every running one (the replica
/// already checked the client's right to reach it; traffic tokens live in the
/// control plane and are checked there).
pub struct NodeResolver {
    node: Node,
}

impl NodeResolver {
    /// Over `node`.
    pub fn new(node: Node) -> Self {
        NodeResolver { node }
    }
}

fn target(info: &cubicle_node::SandboxInfo) -> Option<SandboxTarget> {
    if info.state != SandboxState::Running || info.busy {
        return None;
    }
    Some(SandboxTarget {
        id: info.id.to_string(),
        envd_socket: info.envd_socket.clone(),
        init_pidfd: info.init_pidfd.as_ref().map(|p| p.fd().clone()),
        envd_access_token: Some(info.access_token.clone()),
        traffic_access_token: None,
        mask_request_host: info.mask_request_host.clone(),
    })
}

impl SandboxResolver for NodeResolver {
    fn resolve(&self, id: &str) -> Option<SandboxTarget> {
        target(&self.node.peek(id).ok()?)
    }

    fn running(&self) -> Vec<SandboxTarget> {
        self.node.list().iter().filter_map(target).collect()
    }

    fn take_envd_conn(&self, id: &str) -> Option<std::os::unix::net::UnixStream> {
        self.node.take_envd_conn(id)
    }
}

#[derive(Clone)]
struct NodeApi {
    node: Node,
    journal: Arc<std::sync::Mutex<StatusJournal>>,
}

/// What the entry of every request needs: the data plane and the token.
#[derive(Clone)]
struct Guard {
    dp: DataPlane,
    token: Arc<str>,
}

/// The node-side API over `node`, its data plane `dp` (built over a [`NodeResolver`]),
/// accepting `token`.
pub fn node_router(node: Node, dp: DataPlane, token: &str) -> Router {
    node_router_with(node, dp, token, Router::new())
}

/// [`node_router`] with `extra` routes under `/node/v1` (the builder API,
/// `super::templates::node_routes`).
pub fn node_router_with(node: Node, dp: DataPlane, token: &str, extra: Router) -> Router {
    let moving = super::moving_api::routes(node.clone());
    let st = NodeApi {
        node,
        journal: Arc::default(),
    };
    let api = Router::new()
        .route("/status", get(status))
        .route("/templates/exists", get(template_exists))
        .route("/network/check", post(check_network))
        .route("/sandboxes", post(create))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/stats", get(stats))
        .route("/sandboxes/{id}/init-log", get(init_log))
        .route("/init-logs/grown", get(grown_logs))
        .route("/sandboxes/{id}/network", post(update_network))
        .route(
            "/sandboxes/{id}/network-log",
            get(network_log).delete(forget_network_log),
        )
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/snapshot", post(snapshot))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/rollback", post(rollback))
        .route("/snapshots/{id}", delete(delete_snapshot))
        .with_state(st)
        .merge(moving)
        .merge(extra);
    authenticated(api, dp, token)
}

/// `api` under `/node/v1/`, behind the node token, with relayed data-plane requests
/// (those carrying `cubicle-node-token`) handed to `dp` (public for tests of the guard).
pub fn authenticated(api: Router, dp: DataPlane, token: &str) -> Router {
    let g = Guard {
        dp,
        token: token.into(),
    };
    Router::new()
        .nest(super::PREFIX, api)
        .layer(axum::middleware::from_fn_with_state(g, entry))
}

fn unauthorized(what: &str) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        Json(serde_json::json!({
            "code": 401,
            "message": format!("{what}: this is a cubicle node; only API replicas with the cluster's node token may call it"),
        })),
    )
        .into_response()
}

/// Every request: a relayed data-plane request (node token header) goes to the data
/// plane; anything else must carry the bearer token.
async fn entry(State(st): State<Guard>, mut req: Request, next: Next) -> Response {
    if let Some(given) = req.headers_mut().remove(NODE_TOKEN_HEADER) {
        let ok = token_matches(&st.token, given.to_str().unwrap_or(""));
        if !ok {
            return unauthorized("wrong node token");
        }
        return st.dp.handle(req).await;
    }
    let verdict = match req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        Some(t) if token_matches(&st.token, t.trim()) => None,
        Some(_) => Some("wrong node token"),
        None => Some("missing Authorization: Bearer <node token>"),
    };
    match verdict {
        None => next.run(req).await,
        Some(why) => unauthorized(why),
    }
}

pub(super) fn fail(e: cubicle_node::Error) -> Response {
    let w = WireError::from_node(&e);
    let status = StatusCode::from_u16(w.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(w)).into_response()
}

pub(super) fn answer<T: serde::Serialize>(r: cubicle_node::Result<T>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => fail(e),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> cubicle_node::Result<T> + Send + 'static,
) -> cubicle_node::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(cubicle_node::Error::Runtime(format!("task failed: {e}"))))
}

/// `GET /status`'s query: the journal mark of the replica's last answer (and
/// `GET /init-logs/grown`'s: the log mark of its last answer).
#[derive(Deserialize)]
struct StatusQuery {
    epoch: Option<u64>,
    since: Option<u64>,
}

async fn status(State(st): State<NodeApi>, Query(q): Query<StatusQuery>) -> Response {
    let node = st.node.clone();
    let since = q
        .epoch
        .zip(q.since)
        .map(|(epoch, generation)| JournalMark { epoch, generation });
    let r = blocking(move || {
        let host = cubicle_node::host::stats(&node.config().state_dir);
        let version = node.listing_version();
        let j = st.journal.lock().unwrap_or_else(|p| p.into_inner()).answer(
            version,
            || node.list(),
            since,
        );
        Ok(NodeStatus {
            sandboxes: j.sandboxes,
            delta: j.delta,
            removed: j.removed,
            count: j.count,
            journal: Some(j.mark),
            pool: node.pool_stats(),
            host: WireHost::from(&host),
            max_sandboxes: node.config().max_sandboxes,
            snapshots: node.snapshots(),
            layers_in_use: Backend::layers_in_use(&node).into_iter().collect(),
            draining: super::moving_api::is_draining(&node),
        })
    })
    .await;
    answer(r)
}

#[derive(Deserialize)]
struct NameQuery {
    name: String,
}

async fn template_exists(State(st): State<NodeApi>, Query(q): Query<NameQuery>) -> Response {
    let node = st.node.clone();
    answer(blocking(move || Backend::template_exists(&node, &q.name)).await)
}

async fn check_network(State(st): State<NodeApi>, Json(p): Json<NetworkPolicy>) -> Response {
    answer(st.node.check_network(&p).await)
}

async fn create(State(st): State<NodeApi>, Json(req): Json<CreateRequest>) -> Response {
    // The first command does not pay for the data plane's connection to envd: the
    // node keeps the one its create made (`take_envd_conn`).
    answer(st.node.create(req).await)
}

async fn info(State(st): State<NodeApi>, Path(id): Path<String>) -> Response {
    answer(st.node.info(&id).await)
}

async fn kill(State(st): State<NodeApi>, Path(id): Path<String>) -> Response {
    match st.node.kill(&id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => fail(e),
    }
}

async fn set_timeout(
    State(st): State<NodeApi>,
    Path(id): Path<String>,
    Json(t): Json<WireTimeout>,
) -> Response {
    let node = st.node.clone();
    answer(
        blocking(move || {
            node.set_timeout(&id, Duration::from_millis(t.timeout_ms))?;
            node.peek(&id)
        })
        .await,
    )
}

async fn stats(State(st): State<NodeApi>, Path(id): Path<String>) -> Response {
    let node = st.node.clone();
    answer(blocking(move || node.stats(&id)).await)
}

/// `GET /init-logs/grown?epoch=E&since=G`: the sandboxes whose init log grew after the
/// mark of the replica's last answer (all of them may have without one, or from another
/// node process), and the mark to ask with next. 404 when the node's runtime cannot tell.
async fn grown_logs(State(st): State<NodeApi>, Query(q): Query<StatusQuery>) -> Response {
    let since = q
        .epoch
        .zip(q.since)
        .map(|(epoch, generation)| cubicle_node::init_log::LogMark { epoch, generation });
    match st.node.grown_logs(since) {
        Some(g) => Json(g).into_response(),
        None => fail(cubicle_node::Error::Unsupported(
            "this node's runtime does not follow its logs' growth".into(),
        )),
    }
}

#[derive(Deserialize)]
struct InitLogQuery {
    #[serde(default)]
    offset: u64,
}

/// Most of a sandbox's envd log one call returns (a replica asks again for the rest).
const INIT_LOG_CHUNK: u64 = 256 * 1024;

/// Sandbox `id`'s envd log from byte `offset` on (at most [`INIT_LOG_CHUNK`] bytes;
/// empty when there is no more), for a replica's copy.
async fn init_log(
    State(st): State<NodeApi>,
    Path(id): Path<String>,
    Query(q): Query<InitLogQuery>,
) -> Response {
    let node = st.node.clone();
    answer(
        blocking(move || {
            // (an id names a directory: nothing but what ids are made of)
            if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(cubicle_node::Error::SandboxNotFound(id));
            }
            node.peek(&id)?;
            let path = node.sandbox_dir(&id).join(cubicle_node::init_log::INIT_LOG);
            read_from(&path, q.offset)
        })
        .await,
    )
}

fn read_from(path: &std::path::Path, offset: u64) -> cubicle_node::Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(cubicle_node::Error::io("reading", path, e)),
    };
    let mut out = Vec::new();
    f.seek(SeekFrom::Start(offset))
        .and_then(|_| f.take(INIT_LOG_CHUNK).read_to_end(&mut out))
        .map_err(|e| cubicle_node::Error::io("reading", path, e))?;
    Ok(out)
}

async fn update_network(
    State(st): State<NodeApi>,
    Path(id): Path<String>,
    Json(p): Json<NetworkPolicy>,
) -> Response {
    answer(st.node.update_network(&id, p).await)
}

#[derive(Deserialize)]
struct LogQuery {
    #[serde(default)]
    after: u64,
    #[serde(default)]
    limit: Option<usize>,
}

async fn network_log(
    State(st): State<NodeApi>,
    Path(id): Path<String>,
    Query(q): Query<LogQuery>,
) -> Response {
    let events = st
        .node
        .network_log(&id, q.after, q.limit.unwrap_or(usize::MAX))
        .await;
    Json(events).into_response()
}

async fn forget_network_log(State(st): State<NodeApi>, Path(id): Path<String>) -> Response {
    st.node.forget_network_log(&id);
    StatusCode::NO_CONTENT.into_response()
}

async fn pause(
    State(st): State<NodeApi>,
    Path(id): Path<String>,
    Json(req): Json<PauseRequest>,
) -> Response {
    answer(st.node.pause(&id, req).await)
}

async fn resume(
    State(st): State<NodeApi>,
    Path(id): Path<String>,
    Json(t): Json<WireTimeout>,
) -> Response {
    if super::moving_api::is_draining(&st.node)
        && st
            .node
            .peek(&id)
            .is_ok_and(|i| i.state == SandboxState::Paused)
    {
        return fail(super::moving_api::draining_error(&st.node));
    }
    answer(
        st.node
            .resume(&id, Duration::from_millis(t.timeout_ms), t.memory)
            .await,
    )
}

async fn snapshot(
    State(st): State<NodeApi>,
    Path(id): Path<String>,
    Json(req): Json<SnapshotRequest>,
) -> Response {
    answer(st.node.snapshot(&id, req).await)
}

async fn fork(
    State(st): State<NodeApi>,
    Path(id): Path<String>,
    Json(t): Json<WireTimeout>,
) -> Response {
    let r = st
        .node
        .fork(&id, t.count, Duration::from_millis(t.timeout_ms))
        .await
        .map(|v| {
            v.into_iter()
                .map(|r| match r {
                    Ok(info) => WireResult::Ok(info),
                    Err(e) => WireResult::Err(WireError::from_node(&e)),
                })
                .collect::<Vec<_>>()
        });
    answer(r)
}

#[derive(Deserialize)]
struct RollbackBody {
    snapshot: String,
}

async fn rollback(
    State(st): State<NodeApi>,
    Path(id): Path<String>,
    Json(b): Json<RollbackBody>,
) -> Response {
    answer(st.node.rollback(&id, &b.snapshot).await)
}

async fn delete_snapshot(State(st): State<NodeApi>, Path(id): Path<String>) -> Response {
    match st.node.delete_snapshot(&id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => fail(e),
    }
}
