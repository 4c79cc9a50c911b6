//! The cluster's role split without sandboxes: the node-side API's guard (token on the
//! API and on relayed data-plane requests) and an API replica whose node is unreachable
//! (clear errors in E2B's shape, on the REST API and on the data plane).

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use axum::{
    Json, Router,
    body::Body,
    http::{Method, Request, StatusCode},
    routing::{get, post},
};
use cubicle_api::Backend;
use cubicle_api::backend::LogMarks;
use cubicle_api::cluster::{
    JournalMark, NodeStatus, RemoteBackend, RemoteConfig, StatusJournal, WireError, WireHost,
    authenticated,
};
use cubicle_node::init_log::{GrownLogs, LogMark};
use cubicle_router::{
    DataPlane, NODE_TOKEN_HEADER, Relay, RouterConfig, SandboxResolver, SandboxTarget,
};
use serde_json::Value;
use tower::ServiceExt;

const TOKEN: &str = "0123456789abcdef0123456789abcdef-node-token";

/// A resolver that knows one fake sandbox (for presigned lookups and routing).
struct OneSandbox;

impl SandboxResolver for OneSandbox {
    fn resolve(&self, id: &str) -> Option<SandboxTarget> {
        (id == "sbx1").then(|| SandboxTarget {
            id: "sbx1".into(),
            envd_socket: "/nonexistent/envd.sock".into(),
            init_pidfd: None,
            envd_access_token: None,
            traffic_access_token: None,
            mask_request_host: None,
        })
    }
    fn running(&self) -> Vec<SandboxTarget> {
        Vec::new()
    }
}

struct NoSandbox;

impl SandboxResolver for NoSandbox {
    fn resolve(&self, _: &str) -> Option<SandboxTarget> {
        None
    }
    fn running(&self) -> Vec<SandboxTarget> {
        Vec::new()
    }
}

fn guarded() -> Router {
    let api = Router::new().route("/status", get(|| async { Json(NodeStatus::default()) }));
    let dp = DataPlane::new(Arc::new(NoSandbox), RouterConfig::default());
    authenticated(api, dp, TOKEN)
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, Value) {
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

fn status_req(auth: Option<&str>) -> Request<Body> {
    let mut r = Request::builder().uri("/node/v1/status");
    if let Some(a) = auth {
        r = r.header("authorization", a);
    }
    r.body(Body::empty()).unwrap()
}

#[tokio::test]
async fn node_api_needs_the_token() {
    let app = guarded();
    for auth in [None, Some("Bearer wrong"), Some(TOKEN), Some("Basic abc")] {
        let (status, body) = send(&app, status_req(auth)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{auth:?}");
        assert_eq!(body["code"], 401, "{body}");
        assert!(
            body["message"].as_str().unwrap().contains("node token"),
            "{body}"
        );
    }
    let (status, body) = send(&app, status_req(Some(&format!("Bearer {TOKEN}")))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["sandboxes"].is_array(), "{body}");

    // Relayed data-plane requests: the token is in its own header (the client's
    // Authorization belongs to the sandbox's port), checked, then removed.
    let dp_req = |token: &str| {
        Request::builder()
            .uri("/health")
            .header("e2b-sandbox-id", "sbx1")
            .header("e2b-sandbox-port", "49983")
            .header(NODE_TOKEN_HEADER, token)
            .body(Body::empty())
            .unwrap()
    };
    let (status, body) = send(&app, dp_req("wrong")).await;
    assert_eq!(
        (status, body["code"].clone()),
        (StatusCode::UNAUTHORIZED, 401.into())
    );
    // With the token it reaches the node's data plane, which knows no such sandbox.
    let (status, body) = send(&app, dp_req(TOKEN)).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert_eq!(body["message"], "The sandbox was not found", "{body}");
    // Without any token, a data-plane-looking request is refused too.
    let req = Request::builder()
        .uri("/health")
        .header("e2b-sandbox-id", "sbx1")
        .header("e2b-sandbox-port", "49983")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, req).await.0, StatusCode::UNAUTHORIZED);
}

/// Serves the node-side routes `api` behind the token guard on a free port; returns the
/// address and a handle that stops it.
async fn serve_node(api: Router) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let dp = DataPlane::new(Arc::new(NoSandbox), RouterConfig::default());
    let app = authenticated(api, dp, TOKEN);
    let h = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, h)
}

/// A node-side API on a free port; returns its address and a handle that stops it.
async fn fake_node() -> (String, tokio::task::JoinHandle<()>) {
    let api = Router::new()
        .route(
            "/status",
            get(|| async {
                Json(NodeStatus {
                    max_sandboxes: 10,
                    ..Default::default()
                })
            }),
        )
        .route("/templates/exists", get(|| async { Json(true) }));
    serve_node(api).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_with_a_wrong_token_or_no_node_says_why() {
    let (addr, h) = fake_node().await;
    let mut cfg = RemoteConfig::new(vec![format!("http://{addr}")], "wrong-token".into());
    cfg.poll_interval = Duration::from_millis(50);
    let e = RemoteBackend::connect(cfg)
        .await
        .err()
        .expect("a wrong token must fail");
    assert!(e.to_string().contains("401"), "{e}");
    assert!(e.to_string().contains("--node-token-file"), "{e}");
    h.abort();
    let e = RemoteBackend::connect(RemoteConfig::new(
        vec![format!("http://{addr}")],
        TOKEN.into(),
    ))
    .await
    .err()
    .expect("no node answering must fail");
    assert!(e.to_string().contains("unreachable"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_with_an_unreachable_node_answers_in_e2b_shape() {
    let (addr, h) = fake_node().await;
    let mut cfg = RemoteConfig::new(vec![format!("http://{addr}")], TOKEN.into());
    cfg.poll_interval = Duration::from_millis(50);
    let remote = RemoteBackend::connect(cfg).await.unwrap();
    let poller = remote.spawn_poller();
    let dir = std::env::temp_dir().join(format!("cubicle-cluster-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = cubicle_store::Store::open_in_memory().unwrap();
    let team = store.ensure_team("a").unwrap();
    let key = store.create_api_key(team.id).unwrap().plaintext;
    let cp = cubicle_api::ControlPlane::open(
        Arc::new(remote.clone()),
        store,
        cubicle_api::ApiConfig::new(dir.join("logs")),
    )
    .await
    .unwrap();
    let app = cubicle_api::router(cp);

    // The node goes away; the replica notices at its next poll.
    h.abort();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        remote.nodes()[0].1.is_some(),
        "the node should be marked down"
    );
    let req = Request::builder()
        .method(Method::POST)
        .uri("/sandboxes")
        .header("x-api-key", &key)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"templateID":"base"}"#))
        .unwrap();
    let (status, body) = send(&app, req).await;
    assert!(status.is_server_error(), "{status} {body}");
    assert_eq!(body["code"], status.as_u16(), "{body}");
    let msg = body["message"].as_str().unwrap();
    assert!(msg.contains(&addr) && msg.contains("unreachable"), "{msg}");

    // The data plane's relay to a node that is gone: 502 in E2B's shape, naming it.
    let relay = Relay::new(TOKEN, &RouterConfig::default()).unwrap();
    let dp = DataPlane::new(Arc::new(OneSandbox), RouterConfig::default());
    let req = Request::builder()
        .uri("/health")
        .header("e2b-sandbox-id", "sbx1")
        .header("e2b-sandbox-port", "49983")
        .body(Body::empty())
        .unwrap();
    let (a, req) = dp.admit(req).await.unwrap();
    let resp = relay.forward(req, &a, &addr).await;
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(body["code"], 502, "{body}");
    let msg = body["message"].as_str().unwrap();
    assert!(
        msg.contains(&addr) && msg.contains("sbx1") && msg.contains("unreachable"),
        "{msg}"
    );
    poller.abort();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node-side API that reports `memory_available` and answers every create with `err`.
async fn refusing_node(
    memory_available: u64,
    err: WireError,
) -> (String, tokio::task::JoinHandle<()>) {
    let status = NodeStatus {
        max_sandboxes: 10,
        host: WireHost {
            memory_available,
            ..Default::default()
        },
        ..Default::default()
    };
    let api = Router::new()
        .route("/status", get(move || async move { Json(status.clone()) }))
        .route("/templates/exists", get(|| async { Json(true) }))
        .route(
            "/sandboxes",
            post(
                move || async move { (StatusCode::from_u16(err.code).unwrap(), Json(err.clone())) },
            ),
        );
    serve_node(api).await
}

fn wire(code: u16, kind: &str, subject: &str) -> WireError {
    WireError {
        code,
        message: subject.into(),
        kind: kind.into(),
        subject: subject.into(),
    }
}

/// The replica counts a node's sandboxes from its own cache, which misses creates still
/// under way: a node that answers it has no slot left must not end a create another
/// node can take (seen with two nodes filling to 10,000: 272 creates failed "all 6000
/// sandbox slots are in use" while the other node had room).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_node_sends_the_create_to_the_next() {
    let full = wire(503, "capacity", "all 10 sandbox slots are in use");
    // The full node has more free memory, so placement picks it first.
    let (a, ha) = refusing_node(8 << 30, full.clone()).await;
    let (b, hb) = refusing_node(1 << 30, wire(400, "invalid", "node b was asked")).await;
    let mut cfg = RemoteConfig::new(
        vec![format!("http://{a}"), format!("http://{b}")],
        TOKEN.into(),
    );
    cfg.poll_interval = Duration::from_millis(50);
    let remote = RemoteBackend::connect(cfg).await.unwrap();
    let req = cubicle_node::CreateRequest {
        template: "tiny".into(),
        ..Default::default()
    };
    let e = remote.create(req.clone()).await.unwrap_err();
    assert!(
        matches!(&e, cubicle_node::Error::InvalidRequest(m) if m == "node b was asked"),
        "the create should have gone on to node b: {e}"
    );

    // Every node full: a capacity error that names them.
    hb.abort();
    let (c, hc) = refusing_node(1 << 30, full).await;
    let mut cfg = RemoteConfig::new(
        vec![format!("http://{a}"), format!("http://{c}")],
        TOKEN.into(),
    );
    cfg.poll_interval = Duration::from_millis(50);
    let remote = RemoteBackend::connect(cfg).await.unwrap();
    let e = remote.create(req).await.unwrap_err();
    match &e {
        cubicle_node::Error::Capacity(m) => {
            assert!(m.contains(&a) && m.contains(&c), "{m}")
        }
        other => panic!("expected a capacity error, got {other}"),
    }
    ha.abort();
    hc.abort();
}

fn info(id: &str, end_at_ms: u64) -> cubicle_node::SandboxInfo {
    serde_json::from_value(serde_json::json!({
        "id": id, "template": "base", "state": "running", "deathReason": null,
        "createdAtMs": 1, "endAtMs": end_at_ms, "memoryMb": 512, "cpus": 2, "diskMb": 5120,
        "internet": true, "network": {}, "maskRequestHost": null, "metadata": {},
        "accessToken": "t", "uidBase": 100000, "pid": null, "envdSocket": "/nonexistent",
        "readyUs": 0, "lifecycle": {}, "busy": false, "pauseMode": null,
        "pausedAtMs": null, "envdUnresponsiveAtPause": false, "timeoutMs": 300000,
        "oomKills": 0, "volumes": [], "claimed": false,
    }))
    .unwrap()
}

/// One status answer: the query asked, whether it was a delta, how many sandboxes it
/// sent, the ids it removed.
type Answer = (String, bool, usize, Vec<String>);

/// A fake node whose status goes through a real [`StatusJournal`]: what it lists, and
/// per answer the query asked and (delta, sandboxes sent, ids removed).
#[derive(Clone, Default)]
struct JournalNode {
    /// Its listing version and sandboxes.
    listed: Arc<std::sync::Mutex<(u64, Vec<cubicle_node::SandboxInfo>)>>,
    journal: Arc<std::sync::Mutex<StatusJournal>>,
    answers: Arc<std::sync::Mutex<Vec<Answer>>>,
    /// What `GET /init-logs/grown` says grew (to a query with a mark), and the queries.
    grown: Arc<std::sync::Mutex<Vec<String>>>,
    log_queries: Arc<std::sync::Mutex<Vec<String>>>,
}

impl JournalNode {
    fn set(&self, v: Vec<cubicle_node::SandboxInfo>) {
        let mut l = self.listed.lock().unwrap();
        *l = (l.0 + 1, v);
    }
    fn last(&self) -> Answer {
        self.answers.lock().unwrap().last().cloned().unwrap()
    }
    /// Waits until a poll made wholly after now was applied (the replica's poller runs),
    /// and returns the answers from now on summed up: the last query, whether all were
    /// deltas, how many sandboxes they sent, the ids they removed.
    async fn polled(&self) -> Answer {
        let n = self.answers.lock().unwrap().len();
        for _ in 0..500 {
            let a = self.answers.lock().unwrap()[n..].to_vec();
            if a.len() >= 3 {
                return (
                    a[a.len() - 1].0.clone(),
                    a.iter().all(|x| x.1),
                    a.iter().map(|x| x.2).sum(),
                    a.iter().flat_map(|x| x.3.clone()).collect(),
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the replica stopped polling");
    }
    async fn serve(&self) -> (String, tokio::task::JoinHandle<()>) {
        let me = self.clone();
        let me2 = self.clone();
        let api = Router::new()
            .route(
                "/status",
                get(move |uri: axum::http::Uri| async move {
                    let q = uri.query().unwrap_or("").to_string();
                    let mark = q.split_once("epoch=").and_then(|(_, rest)| {
                        let (e, s) = rest.split_once("&since=")?;
                        Some(JournalMark {
                            epoch: e.parse().ok()?,
                            generation: s.parse().ok()?,
                        })
                    });
                    let (version, list) = me.listed.lock().unwrap().clone();
                    let j = me.journal.lock().unwrap().answer(version, || list, mark);
                    me.answers.lock().unwrap().push((
                        q,
                        j.delta,
                        j.sandboxes.len(),
                        j.removed.clone(),
                    ));
                    Json(NodeStatus {
                        sandboxes: j.sandboxes,
                        delta: j.delta,
                        removed: j.removed,
                        count: j.count,
                        journal: Some(j.mark),
                        max_sandboxes: 10,
                        ..Default::default()
                    })
                }),
            )
            .route("/templates/exists", get(|| async { Json(true) }))
            .route(
                "/init-logs/grown",
                get(move |uri: axum::http::Uri| async move {
                    let q = uri.query().unwrap_or("").to_string();
                    let mut qs = me2.log_queries.lock().unwrap();
                    qs.push(q.clone());
                    Json(GrownLogs {
                        mark: LogMark {
                            epoch: 7,
                            generation: qs.len() as u64,
                        },
                        ids: q
                            .contains("epoch=7&")
                            .then(|| me2.grown.lock().unwrap().clone()),
                    })
                }),
            );
        serve_node(api).await
    }
}

/// The replica's poll asks a node for what changed since its last answer (a node of
/// 6,000 sandboxes answered 4 MB every 500 ms, in up to 9 s: the replica marked it down),
/// and its view follows creates, changes and removals as the full list did; a node that
/// restarted (a new journal) is listed whole again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_brings_only_what_changed() {
    let node = JournalNode::default();
    node.set(vec![info("a", 1), info("b", 1)]);
    let (addr, h) = node.serve().await;
    let mut cfg = RemoteConfig::new(vec![format!("http://{addr}")], TOKEN.into());
    cfg.poll_interval = Duration::from_millis(20);
    let rb = RemoteBackend::connect(cfg).await.unwrap();
    let (q, delta, n, _) = node.last();
    assert_eq!((q.as_str(), delta, n), ("", false, 2));
    let poller = rb.spawn_poller();
    assert_eq!(rb.peek("a").unwrap().end_at_ms, 1);

    // b's end time moves, c comes, a goes: only those cross the wire.
    node.set(vec![info("b", 2), info("c", 1)]);
    let (q, delta, n, removed) = node.polled().await;
    assert!(q.contains("since="), "{q}");
    assert_eq!((delta, n, removed), (true, 2, vec!["a".to_string()]));
    assert!(matches!(
        rb.peek("a"),
        Err(cubicle_node::Error::SandboxNotFound(_))
    ));
    assert_eq!(rb.peek("b").unwrap().end_at_ms, 2);
    assert_eq!(rb.peek("c").unwrap().end_at_ms, 1);

    // Nothing changed: nothing sent, nothing lost.
    let (_, delta, n, removed) = node.polled().await;
    assert_eq!((delta, n, removed.len()), (true, 0, 0));
    assert!(rb.peek("b").is_ok() && rb.peek("c").is_ok());

    // The node restarted with d alone: a new journal, so the full list, and the
    // replica's b and c are gone.
    *node.journal.lock().unwrap() = StatusJournal::new();
    node.set(vec![info("d", 1)]);
    let (_, delta, n, _) = node.polled().await;
    assert_eq!((delta, n), (false, 1));
    node.polled().await;
    assert!(rb.peek("d").is_ok());
    for gone in ["b", "c"] {
        assert!(rb.peek(gone).is_err(), "{gone} should be gone");
    }
    poller.abort();
    h.abort();
}

/// The replica's upkeep asks each node which envd logs grew since its last answer and
/// fetches only those (it fetched every sandbox's, every second: 10,000 calls a second
/// to the nodes of 10,000 idle sandboxes); without a mark of the node's it takes every
/// sandbox the node lists, and from a node that is down none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_fetches_only_the_logs_that_grew() {
    let node = JournalNode::default();
    node.set(vec![info("a", 1), info("b", 1), info("c", 1)]);
    let (addr, h) = node.serve().await;
    let mut cfg = RemoteConfig::new(vec![format!("http://{addr}")], TOKEN.into());
    cfg.poll_interval = Duration::from_millis(20);
    let rb = RemoteBackend::connect(cfg).await.unwrap();
    let sorted = |s: std::collections::HashSet<String>| {
        let mut v: Vec<String> = s.into_iter().collect();
        v.sort();
        v
    };
    let mut marks = LogMarks::default();
    let first = rb.grown_logs(&mut marks).await.expect("a replica can tell");
    assert_eq!(sorted(first), ["a", "b", "c"]);
    assert_eq!(node.log_queries.lock().unwrap().last().unwrap(), "");

    *node.grown.lock().unwrap() = vec!["b".to_string()];
    let grown = rb.grown_logs(&mut marks).await.unwrap();
    assert_eq!(sorted(grown), ["b"]);
    assert_eq!(
        node.log_queries.lock().unwrap().last().unwrap(),
        "epoch=7&since=1"
    );
    *node.grown.lock().unwrap() = vec![];
    assert!(rb.grown_logs(&mut marks).await.unwrap().is_empty());

    // The node goes away: once a poll noticed, none of its logs is asked for.
    let poller = rb.spawn_poller();
    h.abort();
    let t = std::time::Instant::now();
    while rb.nodes()[0].1.is_none() {
        assert!(t.elapsed() < Duration::from_secs(10), "never marked down");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let asked = node.log_queries.lock().unwrap().len();
    assert!(rb.grown_logs(&mut marks).await.unwrap().is_empty());
    assert_eq!(node.log_queries.lock().unwrap().len(), asked);
    poller.abort();
}
