//! The replica's side of moving paused sandboxes between nodes (`cluster::migrate`),
//! without sandboxes: fake nodes (the node-side API's routes, answering as a node does)
//! record what the replica asks of them. A resume of a sandbox paused on a draining or
//! unreachable node goes to the other node (push on the old one when it answers, takeover
//! on the new one, release on the old one — now, or when it answers again), and the
//! replica routes it to its new node from then on, whatever the old one still lists.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::{get, post},
};
use cubicle_api::backend::Backend;
use cubicle_api::cluster::{NodeStatus, RemoteBackend, RemoteConfig, authenticated};
use cubicle_node::{SandboxInfo, SandboxState};
use cubicle_router::{DataPlane, RouterConfig, SandboxResolver, SandboxTarget};
use serde_json::json;

const TOKEN: &str = "0123456789abcdef0123456789abcdef-node-token";
const SBX: &str = "imovingsandbox0000001";

struct NoSandbox;

impl SandboxResolver for NoSandbox {
    fn resolve(&self, _: &str) -> Option<SandboxTarget> {
        None
    }
    fn running(&self) -> Vec<SandboxTarget> {
        Vec::new()
    }
}

fn info(state: &str) -> SandboxInfo {
    serde_json::from_value(json!({
        "id": SBX, "template": "base", "state": state, "deathReason": null,
        "createdAtMs": 1, "endAtMs": 0, "memoryMb": 512, "cpus": 2, "diskMb": 5120,
        "internet": true, "network": {}, "maskRequestHost": null, "metadata": {},
        "accessToken": "t", "uidBase": 100000, "pid": null, "envdSocket": "/nonexistent",
        "readyUs": 0, "lifecycle": {}, "busy": false, "pauseMode": null,
        "pausedAtMs": null, "envdUnresponsiveAtPause": false, "timeoutMs": 300000,
        "oomKills": 0, "volumes": [], "claimed": false,
    }))
    .expect("a SandboxInfo")
}

/// A fake node: what it lists, whether it answers and drains, and the calls it got.
#[derive(Clone, Default)]
struct Fake {
    listed: Arc<Mutex<Vec<SandboxInfo>>>,
    up: Arc<AtomicBool>,
    draining: Arc<AtomicBool>,
    /// Its release does not take effect (it keeps listing the sandbox).
    sticky: Arc<AtomicBool>,
    /// Its release takes 300 ms (several polls see the sandbox meanwhile).
    slow_release: Arc<AtomicBool>,
    calls: Arc<Mutex<Vec<String>>>,
}

impl Fake {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
    fn log(&self, what: String) {
        self.calls.lock().unwrap().push(what);
    }
}

async fn status(State(f): State<Fake>) -> Response {
    if !f.up.load(Ordering::SeqCst) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "down").into_response();
    }
    Json(NodeStatus {
        sandboxes: f.listed.lock().unwrap().clone(),
        max_sandboxes: 10,
        draining: f.draining.load(Ordering::SeqCst),
        ..Default::default()
    })
    .into_response()
}

async fn resume(State(f): State<Fake>, Path(id): Path<String>) -> Response {
    f.log(format!("resume {id}"));
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"code": 503, "message": "full", "kind": "capacity", "subject": "full"})),
    )
        .into_response()
}

async fn push(State(f): State<Fake>, Path(id): Path<String>) -> Response {
    f.log(format!("push {id}"));
    Json(json!({"bytes": 0, "tookMs": 0.0})).into_response()
}

async fn release(State(f): State<Fake>, Path(id): Path<String>) -> Response {
    f.log(format!("release {id}"));
    if f.slow_release.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    if !f.sticky.load(Ordering::SeqCst) {
        f.listed.lock().unwrap().retain(|s| s.id.as_str() != id);
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn takeover(State(f): State<Fake>, Path(id): Path<String>) -> Response {
    f.log(format!("takeover {id}"));
    let running = info("running");
    f.listed.lock().unwrap().push(running.clone());
    Json(json!({
        "outcome": {"info": running, "resumed": true, "took": {"secs": 0, "nanos": 1000000}},
        "bytes": 1000, "transferMs": 1.0, "pullMs": 2.0, "tookMs": 3.0,
    }))
    .into_response()
}

async fn fake_node(f: Fake) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let api = Router::new()
        .route("/status", get(status))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/push", post(push))
        .route("/sandboxes/{id}/release", post(release))
        .route("/sandboxes/{id}/takeover", post(takeover))
        .with_state(f);
    let dp = DataPlane::new(Arc::new(NoSandbox), RouterConfig::default());
    let app = authenticated(api, dp, TOKEN);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

async fn two_nodes() -> (Fake, Fake, String, String, RemoteBackend) {
    let (a, b) = (Fake::default(), Fake::default());
    a.up.store(true, Ordering::SeqCst);
    b.up.store(true, Ordering::SeqCst);
    a.listed.lock().unwrap().push(info("paused"));
    let (addr_a, addr_b) = (fake_node(a.clone()).await, fake_node(b.clone()).await);
    let mut cfg = RemoteConfig::new(
        vec![format!("http://{addr_a}"), format!("http://{addr_b}")],
        TOKEN.into(),
    );
    cfg.poll_interval = Duration::from_millis(50);
    let rb = RemoteBackend::connect(cfg).await.unwrap();
    assert_eq!(rb.node_of(SBX).as_deref(), Some(addr_a.as_str()));
    (a, b, addr_a, addr_b, rb)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_paused_on_a_full_node_resumes_on_the_other() {
    let (a, b, _, addr_b, rb) = two_nodes().await;
    let out = rb.resume(SBX, Duration::from_secs(60), true).await.unwrap();
    assert_eq!(out.info.state, SandboxState::Running);
    assert_eq!(rb.node_of(SBX).as_deref(), Some(addr_b.as_str()));
    // Tried on its node first (full), then published there, taken over, released.
    let id = SBX;
    assert_eq!(
        a.calls(),
        vec![
            format!("resume {id}"),
            format!("push {id}"),
            format!("release {id}")
        ]
    );
    assert_eq!(b.calls(), vec![format!("takeover {id}")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_node_is_not_asked_to_resume() {
    let (a, b, _, addr_b, rb) = two_nodes().await;
    a.draining.store(true, Ordering::SeqCst);
    let _poller = rb.spawn_poller();
    tokio::time::sleep(Duration::from_millis(200)).await;
    rb.resume(SBX, Duration::from_secs(60), true).await.unwrap();
    assert_eq!(rb.node_of(SBX).as_deref(), Some(addr_b.as_str()));
    let id = SBX;
    assert_eq!(
        a.calls(),
        vec![format!("push {id}"), format!("release {id}")]
    );
    assert_eq!(b.calls(), vec![format!("takeover {id}")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polls_during_the_moves_release_do_not_release_it_again() {
    let (a, b, _, addr_b, rb) = two_nodes().await;
    a.draining.store(true, Ordering::SeqCst);
    a.slow_release.store(true, Ordering::SeqCst);
    let poller = rb.spawn_poller();
    tokio::time::sleep(Duration::from_millis(200)).await;
    rb.resume(SBX, Duration::from_secs(60), true).await.unwrap();
    // Polls (every 50 ms) saw A list it while its release ran, and after.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(rb.node_of(SBX).as_deref(), Some(addr_b.as_str()));
    assert_eq!(
        a.calls(),
        vec![format!("push {SBX}"), format!("release {SBX}")]
    );
    assert_eq!(b.calls(), vec![format!("takeover {SBX}")]);
    assert!(a.listed.lock().unwrap().is_empty());
    poller.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_comes_back_releases_and_never_gets_the_sandbox_back() {
    let (a, b, _, addr_b, rb) = two_nodes().await;
    let poller = rb.spawn_poller();
    a.up.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(200)).await;
    rb.resume(SBX, Duration::from_secs(60), true).await.unwrap();
    assert_eq!(rb.node_of(SBX).as_deref(), Some(addr_b.as_str()));
    assert!(a.calls().is_empty(), "{:?}", a.calls());
    assert_eq!(b.calls(), vec![format!("takeover {SBX}")]);
    // A answers again, still listing its stale paused copy (for a while: its first
    // releases do not take effect): the replica keeps routing to B and tells A to
    // release it until A no longer lists it.
    a.sticky.store(true, Ordering::SeqCst);
    a.up.store(true, Ordering::SeqCst);
    for i in 0..40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(rb.node_of(SBX).as_deref(), Some(addr_b.as_str()));
        if i == 20 {
            a.sticky.store(false, Ordering::SeqCst);
        }
    }
    let calls = a.calls();
    assert!(calls.len() >= 2, "{calls:?}");
    assert!(
        calls.iter().all(|c| *c == format!("release {SBX}")),
        "{calls:?}"
    );
    assert!(a.listed.lock().unwrap().is_empty());
    let n = a.calls().len();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(a.calls().len(), n, "released once it no longer lists it");
    assert_eq!(rb.get(SBX).unwrap().state, SandboxState::Running);
    poller.abort();
}
