//! TLS between an API replica and its nodes, with a CA generated here: a replica reaches
//! an `https://` node that verifies against `--node-ca` (the API calls and the relayed
//! data plane), a certificate from another CA or for another name is refused with an
//! error that says what to fix, a shared node certificate is accepted under
//! `--node-server-name`, and a node requiring client certificates (mutual TLS) admits
//! only a replica that presents one from its client CA.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::{
    Json, Router,
    body::Body,
    http::{Request, StatusCode},
    routing::get,
};
use cubicle_api::cluster::{NodeStatus, RemoteBackend, RemoteConfig, authenticated};
use cubicle_router::{
    DataPlane, NodeTls, Relay, RouterConfig, SandboxResolver, SandboxTarget, ServerLimits,
};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use serde_json::Value;

const TOKEN: &str = "0123456789abcdef0123456789abcdef-node-token";

/// A CA: its certificate's PEM file and what signs with it.
struct Ca {
    pem: PathBuf,
    issuer: Issuer<'static, KeyPair>,
}

fn ca(dir: &Path, name: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::default();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    let cert = p.self_signed(&key).unwrap();
    let pem = dir.join(format!("{name}.pem"));
    std::fs::write(&pem, cert.pem()).unwrap();
    Ca {
        pem,
        issuer: Issuer::new(p, key),
    }
}

/// A certificate for `names` signed by `ca`: (cert PEM file, key PEM file).
fn leaf(dir: &Path, ca: &Ca, file: &str, names: &[&str]) -> (PathBuf, PathBuf) {
    let key = KeyPair::generate().unwrap();
    let p =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    let cert = p.signed_by(&key, &ca.issuer).unwrap();
    let (c, k) = (
        dir.join(format!("{file}.pem")),
        dir.join(format!("{file}.key")),
    );
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    (c, k)
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

/// A node-side API served over TLS (as `cubicle node --tls-cert/--tls-key
/// [--tls-client-ca]`) on a free port; its `host:port` and the task serving it.
async fn tls_node(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> (String, tokio::task::JoinHandle<()>) {
    let cfg = cubicle_api::tls::server_config_with_client_ca(cert, key, client_ca).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
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
        .route(
            "/drain",
            axum::routing::post(|| async {
                Json(cubicle_api::cluster::moving_api::DrainReport {
                    took_ms: 1.0,
                    ..Default::default()
                })
            }),
        );
    let dp = DataPlane::new(Arc::new(NoSandbox), RouterConfig::default());
    let app = authenticated(api, dp, TOKEN);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let h = tokio::spawn(cubicle_router::server::serve(
        listener,
        app,
        ServerLimits::default(),
        Some(acceptor),
        std::future::pending(),
    ));
    (addr, h)
}

fn node_tls(ca: &Path, name: Option<&str>, client: Option<&(PathBuf, PathBuf)>) -> NodeTls {
    let client = client.map(|(c, k)| (c.as_path(), k.as_path()));
    NodeTls {
        config: Arc::new(cubicle_api::tls::node_client_config(Some(ca), client).unwrap()),
        server_name: name.map(|n| rustls::pki_types::ServerName::try_from(n.to_string()).unwrap()),
    }
}

async fn connect(addr: &str, tls: NodeTls) -> Result<RemoteBackend, String> {
    let mut cfg = RemoteConfig::new(vec![format!("https://{addr}")], TOKEN.into());
    cfg.tls = Some(tls);
    RemoteBackend::connect(cfg).await.map_err(|e| e.to_string())
}

/// A relayed data-plane request for sandbox `sbx1` to `addr`: (status, body).
async fn relay_health(relay: &Relay, addr: &str) -> (StatusCode, Value) {
    let dp = DataPlane::new(Arc::new(OneSandbox), RouterConfig::default());
    let req = Request::builder()
        .uri("/health")
        .header("e2b-sandbox-id", "sbx1")
        .header("e2b-sandbox-port", "49983")
        .body(Body::empty())
        .unwrap();
    let (a, req) = dp.admit(req).await.unwrap();
    let resp = relay.forward(req, &a, addr).await;
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// A scratch directory, removed when the returned guard drops (a failed test's too).
fn tempdir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("cubicle-{name}-"))
        .tempdir()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_talks_to_a_tls_node_and_refuses_a_wrong_ca() {
    let tmp = tempdir("cluster-tls");
    let dir = tmp.path();
    let cluster_ca = ca(dir, "cluster-ca");
    let other_ca = ca(dir, "other-ca");
    let (cert, key) = leaf(dir, &cluster_ca, "node", &["127.0.0.1"]);
    let (addr, h) = tls_node(&cert, &key, None).await;

    // The API over TLS, verified against the cluster's CA.
    let remote = connect(&addr, node_tls(&cluster_ca.pem, None, None))
        .await
        .unwrap();
    assert_eq!(remote.nodes(), vec![(addr.clone(), None)]);
    // The data plane over TLS: the request reaches the node's own data plane (which
    // knows no sandbox sbx1), so the token and the TLS session both worked.
    let tls = node_tls(&cluster_ca.pem, None, None);
    let relay = Relay::with_tls(TOKEN, &RouterConfig::default(), Some(&tls)).unwrap();
    let (status, body) = relay_health(&relay, &addr).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert_eq!(body["message"], "The sandbox was not found", "{body}");

    // Another CA: refused, saying it is the certificate and what to check.
    let e = connect(&addr, node_tls(&other_ca.pem, None, None))
        .await
        .err()
        .expect("a node certificate from another CA must be refused");
    assert!(e.contains("TLS handshake failed"), "{e}");
    assert!(
        e.contains("UnknownIssuer") || e.contains("unknown issuer"),
        "{e}"
    );
    assert!(e.contains("--node-ca"), "{e}");
    let tls = node_tls(&other_ca.pem, None, None);
    let relay = Relay::with_tls(TOKEN, &RouterConfig::default(), Some(&tls)).unwrap();
    let (status, body) = relay_health(&relay, &addr).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{body}");
    assert_eq!(body["code"], 502, "{body}");
    let msg = body["message"].as_str().unwrap();
    assert!(msg.contains(&addr) && msg.contains("certificate"), "{msg}");

    // Plain HTTP to a TLS node fails; https:// without TLS set up is refused up front.
    let e = RemoteBackend::connect(RemoteConfig::new(
        vec![format!("http://{addr}")],
        TOKEN.into(),
    ))
    .await
    .err()
    .expect("plain HTTP to a TLS port must fail");
    assert!(e.to_string().contains("unreachable"), "{e}");
    let e = RemoteBackend::connect(RemoteConfig::new(
        vec![format!("https://{addr}")],
        TOKEN.into(),
    ))
    .await
    .err()
    .expect("https:// without TLS configured must be refused");
    assert!(e.to_string().contains("--node-ca"), "{e}");
    h.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_node_certificate_under_a_server_name() {
    let tmp = tempdir("cluster-tls-name");
    let dir = tmp.path();
    let cluster_ca = ca(dir, "cluster-ca");
    // One certificate for every node, naming no address.
    let (cert, key) = leaf(dir, &cluster_ca, "node", &["cubicle-node"]);
    let (addr, h) = tls_node(&cert, &key, None).await;
    let e = connect(&addr, node_tls(&cluster_ca.pem, None, None))
        .await
        .err()
        .expect("a certificate not naming the address must be refused");
    assert!(
        e.contains("NotValidForName") || e.contains("not valid for name"),
        "{e}"
    );
    assert!(e.contains("--node-server-name"), "{e}");
    connect(&addr, node_tls(&cluster_ca.pem, Some("cubicle-node"), None))
        .await
        .unwrap();
    h.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_only_replicas_with_a_client_certificate() {
    let tmp = tempdir("cluster-mtls");
    let dir = tmp.path();
    let cluster_ca = ca(dir, "cluster-ca");
    let client_ca = ca(dir, "replica-ca");
    let stranger_ca = ca(dir, "stranger-ca");
    let (cert, key) = leaf(dir, &cluster_ca, "node", &["127.0.0.1"]);
    let replica = leaf(dir, &client_ca, "replica", &["replica"]);
    let stranger = leaf(dir, &stranger_ca, "stranger", &["replica"]);
    let (addr, h) = tls_node(&cert, &key, Some(&client_ca.pem)).await;

    let e = connect(&addr, node_tls(&cluster_ca.pem, None, None))
        .await
        .err()
        .expect("a replica without a client certificate must be refused");
    assert!(e.contains("unreachable") || e.contains("TLS"), "{e}");
    let e = connect(&addr, node_tls(&cluster_ca.pem, None, Some(&stranger)))
        .await
        .err()
        .expect("a client certificate from another CA must be refused");
    assert!(e.contains("unreachable") || e.contains("TLS"), "{e}");
    connect(&addr, node_tls(&cluster_ca.pem, None, Some(&replica)))
        .await
        .unwrap();
    let tls = node_tls(&cluster_ca.pem, None, Some(&replica));
    let relay = Relay::with_tls(TOKEN, &RouterConfig::default(), Some(&tls)).unwrap();
    let (status, body) = relay_health(&relay, &addr).await;
    assert_eq!(
        (status, body["message"].clone()),
        (StatusCode::BAD_GATEWAY, "The sandbox was not found".into())
    );
    h.abort();
}

/// `cubicle node drain NAME` finds the node's address in the cluster's database; a node
/// registered as `https://…` is reached with the replicas' TLS options, and without them
/// the drain says what is missing (the node is still marked draining: no placements).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_reaches_a_tls_node_named_in_the_cluster_database() {
    use cubicle_api::cluster::coordination::drain;
    use cubicle_store::{NodeCapacity, NodeRegistration, NodeState, Store};
    let tmp = tempdir("drain");
    let dir = tmp.path();
    let ca = ca(dir, "cluster-ca");
    let (cert, key) = leaf(dir, &ca, "node", &["127.0.0.1"]);
    let (addr, _node) = tls_node(&cert, &key, None).await;
    let store = Store::open(&dir.join("cubicle.db")).unwrap();
    let reg = NodeRegistration {
        id: "n1".into(),
        address: format!("https://{addr}"),
        capacity: NodeCapacity {
            cpu_count: 4,
            memory_mb: 4096,
            max_sandboxes: 10,
        },
        templates: vec![],
        pool_state: serde_json::json!({}),
    };
    store
        .register_node(&reg, cubicle_store::now_ms(), 60_000)
        .unwrap();

    let e = drain(&store, "n1", TOKEN, None).await.unwrap_err();
    assert!(e.contains("TLS to the nodes is not set up"), "{e}");
    let n1 = store.node("n1", cubicle_store::now_ms()).unwrap().unwrap();
    assert_eq!(n1.state, NodeState::Draining);

    let report = drain(&store, "n1", TOKEN, Some(node_tls(&ca.pem, None, None)))
        .await
        .unwrap();
    assert!(
        report.failed.is_empty() && report.paused.is_empty(),
        "{report:?}"
    );

    // The node's side of a drain with migration (`cubicle node evacuate --node URL`).
    use cubicle_api::cluster::moving_api::request_drain;
    let url = format!("https://{addr}");
    let e = request_drain(&url, TOKEN, None).await.unwrap_err();
    assert!(
        e.to_string().contains("TLS to the nodes is not set up"),
        "{e}"
    );
    let r = request_drain(&url, TOKEN, Some(node_tls(&ca.pem, None, None)))
        .await
        .unwrap();
    assert_eq!(r.took_ms, 1.0);
    // Both at once (`cubicle node drain n1 --migrate`): marked draining, the node asked.
    store.set_node_draining("n1", false).unwrap();
    let r = cubicle_api::cluster::coordination::drain_migrating(
        &store,
        "n1",
        TOKEN,
        Some(node_tls(&ca.pem, None, None)),
    )
    .await
    .unwrap();
    assert_eq!(r.took_ms, 1.0);
    let n1 = store.node("n1", cubicle_store::now_ms()).unwrap().unwrap();
    assert_eq!(n1.state, NodeState::Draining);
}
