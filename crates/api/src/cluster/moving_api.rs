//! The node-side API's routes for moving paused sandboxes between nodes
//! (docs/cluster.md, "Moving sandboxes between nodes"), merged into
//! [`super::node_router`]; the replica's side is [`super::migrate`].
//!
//! - `POST sandboxes/{id}/push`: publish a paused sandbox (owner record, directory,
//!   record) so another node can take it over ([`Node::publish_paused`]).
//! - `POST sandboxes/{id}/takeover` (`{"timeoutMs", "memory"}`): pull it from the object
//!   store, become its owner and resume it here ([`Node::take_over`]).
//! - `POST sandboxes/{id}/release`: forget a paused sandbox that another node took over
//!   ([`Node::release_moved`]).
//! - `GET published/{id}`: a paused sandbox's info as published in the object store
//!   ([`Node::published_info`]): a replica shows it so while its node is lost and no
//!   node owns it.
//! - `POST drain` (`{"migrate": true}`): the node stops taking sandboxes (resumes here
//!   are refused while it drains, so replicas move them), pauses every running sandbox
//!   with its memory and publishes it; `DELETE drain` ends the drain. The mark is a file
//!   (`<state>/draining`): it outlives a restart.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, post},
};
use cubicle_node::{Node, PauseRequest, SandboxState};
use serde::{Deserialize, Serialize};

use super::WireTimeout;
use super::node_api::{answer, fail};

/// File that marks a node as draining, in its state directory.
const DRAINING_FILE: &str = "draining";

fn draining_path(node: &Node) -> PathBuf {
    node.config().state_dir.join(DRAINING_FILE)
}

/// Whether `node` is draining (its resumes are refused: replicas move its sandboxes).
pub fn is_draining(node: &Node) -> bool {
    draining_path(node).exists()
}

/// The error a resume on a draining node is answered with (a capacity error: replicas
/// take the sandbox to another node).
pub fn draining_error(node: &Node) -> cubicle_node::Error {
    cubicle_node::Error::Capacity(format!(
        "node {} is draining: its sandboxes resume on other nodes",
        node.identity().unwrap_or_default()
    ))
}

/// What a push moved, on the wire.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WireMove {
    pub bytes: u64,
    pub took_ms: f64,
}

/// `POST drain` body.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainRequest {
    /// Pause and publish every sandbox so that it resumes on another node.
    #[serde(default)]
    pub migrate: bool,
}

/// What a drain did.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainReport {
    /// Sandboxes paused (with their memory) by the drain.
    pub paused: Vec<String>,
    /// Sandboxes published to the object store (paused before or by the drain).
    pub published: Vec<String>,
    /// Sandboxes that could not be paused or published, and why (they stay here).
    pub failed: Vec<(String, String)>,
    /// The whole drain, ms.
    pub took_ms: f64,
}

/// Drain with migration: marks `node` draining, then pauses every running sandbox (with
/// its memory) and publishes it and every paused one not yet published, so that each
/// resumes on another node at its next connect. Refused without an object store.
/// (`cubicle node drain --migrate` calls it through `POST /node/v1/drain`.)
pub async fn drain_and_migrate(node: &Node) -> cubicle_node::Result<DrainReport> {
    if node.object_store().is_none() {
        return Err(cubicle_node::Error::Unsupported(
            "draining with migration needs an object store (start the node with --object-store URL)"
                .into(),
        ));
    }
    let t0 = Instant::now();
    mark_draining(node, true)?;
    let mut report = DrainReport::default();
    let publishes = node.object_store().is_some_and(|c| c.publish_paused);
    for info in node.list() {
        let id = info.id.to_string();
        let was_running = match info.state {
            SandboxState::Running => true,
            SandboxState::Paused => false,
            _ => continue,
        };
        if was_running {
            let req = PauseRequest {
                memory: true,
                require_healthy_guest: false,
            };
            if let Err(e) = node.pause(&id, req).await {
                report.failed.push((id, format!("pause: {e}")));
                continue;
            }
            report.paused.push(id.clone());
            if publishes && node.is_published(&id) {
                report.published.push(id);
                continue;
            }
        } else if node.is_published(&id) {
            continue;
        }
        match node.publish_paused(&id).await {
            Ok(_) => report.published.push(id),
            Err(e) => report.failed.push((id, format!("publish: {e}"))),
        }
    }
    report.took_ms = t0.elapsed().as_secs_f64() * 1000.0;
    tracing::info!(
        paused = report.paused.len(),
        published = report.published.len(),
        failed = report.failed.len(),
        took_ms = report.took_ms,
        "drained with migration"
    );
    Ok(report)
}

/// Sets or clears the draining mark.
pub fn mark_draining(node: &Node, on: bool) -> cubicle_node::Result<()> {
    let path = draining_path(node);
    let r = if on {
        std::fs::write(&path, b"")
    } else {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            r => r,
        }
    };
    r.map_err(|e| cubicle_node::Error::Runtime(format!("{}: {e}", path.display())))
}

/// The routes above, over `node`.
pub fn routes(node: Node) -> Router {
    Router::new()
        .route("/sandboxes/{id}/push", post(push))
        .route("/sandboxes/{id}/takeover", post(takeover))
        .route("/sandboxes/{id}/release", post(release))
        .route("/published/{id}", get(published))
        .route("/drain", post(drain).delete(undrain))
        .with_state(node)
}

async fn push(State(node): State<Node>, Path(id): Path<String>) -> Response {
    if node.is_published(&id) {
        // Published at pause and not resumed since: the bucket's copy is current.
        return Json(WireMove::default()).into_response();
    }
    answer(node.publish_paused(&id).await.map(|r| WireMove {
        bytes: r.bytes_moved,
        took_ms: r.took.as_secs_f64() * 1000.0,
    }))
}

async fn takeover(
    State(node): State<Node>,
    Path(id): Path<String>,
    Json(t): Json<WireTimeout>,
) -> Response {
    if is_draining(&node) {
        return fail(draining_error(&node));
    }
    answer(
        node.take_over(&id, Duration::from_millis(t.timeout_ms), t.memory)
            .await,
    )
}

async fn published(State(node): State<Node>, Path(id): Path<String>) -> Response {
    answer(node.published_info(&id).await)
}

async fn release(State(node): State<Node>, Path(id): Path<String>) -> Response {
    match node.release_moved(&id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => fail(e),
    }
}

async fn drain(State(node): State<Node>, Json(req): Json<DrainRequest>) -> Response {
    if !req.migrate {
        return fail(cubicle_node::Error::InvalidRequest(
            "this route drains with migration only: send {\"migrate\": true}".into(),
        ));
    }
    answer(drain_and_migrate(&node).await)
}

async fn undrain(State(node): State<Node>) -> Response {
    match mark_draining(&node, false) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => fail(e),
    }
}

/// Asks the node at `addr` (`http(s)://HOST:PORT`) to drain with migration (`cubicle
/// node evacuate`), authenticated with the node token; `tls` for a node serving TLS, as
/// the replicas reach it.
pub async fn request_drain(
    addr: &str,
    token: &str,
    tls: Option<cubicle_router::NodeTls>,
) -> cubicle_node::Result<DrainReport> {
    let mut cfg = super::RemoteConfig::new(vec![addr.to_string()], token.to_string());
    cfg.tls = tls;
    let rb = super::RemoteBackend::connect(cfg).await?;
    let body = serde_json::to_vec(&DrainRequest { migrate: true })
        .map_err(|e| cubicle_node::Error::Runtime(e.to_string()))?;
    rb.call(0, hyper::Method::POST, "/drain", Some(body), true)
        .await
}
