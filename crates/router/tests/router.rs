//! The data plane end to end: a real `cubicle-envd --dev` on a Unix socket, and TCP
//! servers inside a network namespace standing in for a sandbox (root only; those tests
//! say why they skip otherwise).

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use base64::Engine;
use bytes::Bytes;
use common::*;
use cubicle_router::RouterConfig;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{Value, json};

const ENVD: u16 = 49983;

async fn envd_router(token: &str, id: &str) -> (Envd, Arc<FakeResolver>, std::net::SocketAddr) {
    let envd = Envd::start(token);
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        id,
        &envd.socket,
        std::process::id(),
        Some(token),
        None,
    ));
    let addr = start_router(resolver.clone(), RouterConfig::default()).await;
    (envd, resolver, addr)
}

/// A body sent with `Transfer-Encoding: chunked` (as the Python SDK sends Connect streams).
fn chunked(parts: Vec<Bytes>) -> TestBody {
    let stream = futures_util::stream::iter(
        parts
            .into_iter()
            .map(|b| Ok::<_, std::io::Error>(Frame::data(b))),
    );
    BodyExt::boxed(StreamBody::new(stream))
}

fn start_request(id: &str, token: &str, script: &str) -> hyper::Request<TestBody> {
    let msg = json!({"process": {"cmd": "/bin/sh", "args": ["-c", script]}});
    let r = route(id, ENVD);
    let mut h = hdrs(&r);
    h.extend([
        ("X-Access-Token", token),
        ("Content-Type", "application/connect+json"),
        ("Connect-Protocol-Version", "1"),
        ("Connect-Timeout-Ms", "60000"),
    ]);
    request(
        "POST",
        "/process.Process/Start",
        &h,
        chunked(vec![envelope(0, msg.to_string().as_bytes())]),
    )
}

fn stdout_of(events: &[(u8, Value)]) -> String {
    let mut out = Vec::new();
    for (_, v) in events {
        if let Some(s) = v.pointer("/event/data/stdout").and_then(Value::as_str) {
            out.extend(base64::engine::general_purpose::STANDARD.decode(s).unwrap());
        }
    }
    String::from_utf8(out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_stream_start_echo_hi() {
    let (envd, _r, addr) = envd_router("tok-echo", "sbecho").await;
    let resp = send(addr, start_request("sbecho", &envd.token, "echo hi")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/connect+json");
    let body = body_bytes(resp).await;
    let events = parse_envelopes(&body);
    assert!(
        events[0].1.pointer("/event/start/pid").is_some(),
        "{events:?}"
    );
    assert_eq!(stdout_of(&events), "hi\n");
    assert!(
        events
            .iter()
            .any(|(f, v)| *f == 0 && v.pointer("/event/end").is_some()),
        "{events:?}"
    );
    let (last_flags, last) = events.last().unwrap();
    assert_eq!((*last_flags, last), (2, &json!({})));
}

/// Each Connect message reaches the client when envd writes it, not when the stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_stream_is_not_buffered() {
    let (envd, _r, addr) = envd_router("tok-flush", "sbflush").await;
    let t0 = Instant::now();
    let resp = send(
        addr,
        start_request("sbflush", &envd.token, "echo first; sleep 1.5; echo second"),
    )
    .await;
    let mut body = resp.into_body();
    let mut seen = Vec::new();
    let mut first_at = None;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            seen.extend_from_slice(&data);
            if first_at.is_none() && String::from_utf8_lossy(&seen).contains("Zmlyc3QK") {
                first_at = Some(t0.elapsed());
            }
        }
    }
    let total = t0.elapsed();
    let first_at = first_at.expect("stdout 'first' never arrived");
    assert!(
        first_at < Duration::from_millis(1000),
        "first message after {first_at:?}"
    );
    assert!(
        total >= Duration::from_millis(1400),
        "stream ended after {total:?}"
    );
    assert_eq!(stdout_of(&parse_envelopes(&seen)), "first\nsecond\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_health_unary_and_token_pass_through() {
    let (envd, _r, addr) = envd_router("tok-unary", "sbunary").await;
    let r = route("sbunary", ENVD);
    let resp = send(addr, request("GET", "/health", &hdrs(&r), empty())).await;
    assert_eq!(resp.status(), 204);

    let dir = envd.files_dir();
    std::fs::write(dir.join("x.txt"), "x").unwrap();
    let list = json!({"path": dir.to_str().unwrap(), "depth": 1}).to_string();
    let mut h = hdrs(&r);
    h.extend([
        ("Content-Type", "application/json"),
        ("X-Access-Token", envd.token.as_str()),
    ]);
    let resp = send(
        addr,
        request(
            "POST",
            "/filesystem.Filesystem/ListDir",
            &h,
            full(list.clone()),
        ),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .split(';')
            .next()
            .unwrap(),
        "application/json"
    );
    let v: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert_eq!(v["entries"][0]["name"], "x.txt", "{v}");

    // envd itself checks X-Access-Token: the router passes it unchanged.
    let mut h = hdrs(&r);
    h.extend([
        ("Content-Type", "application/json"),
        ("X-Access-Token", "wrong"),
    ]);
    let resp = send(
        addr,
        request("POST", "/filesystem.Filesystem/ListDir", &h, full(list)),
    )
    .await;
    assert_eq!(resp.status(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_sandbox_is_the_exact_502() {
    let resolver = Arc::new(FakeResolver::default());
    let addr = start_router(resolver, RouterConfig::default()).await;
    for port in [ENVD, 8000] {
        let r = route("nosuchsandbox", port);
        let resp = send(addr, request("GET", "/health", &hdrs(&r), empty())).await;
        assert_eq!(resp.status(), 502);
        assert_eq!(resp.headers()["content-type"], "application/json");
        assert_eq!(resp.headers()["should-retry"], "false");
        assert_eq!(
            body_text(resp).await,
            r#"{"sandboxId":"nosuchsandbox","message":"The sandbox was not found","code":502}"#
        );
        // Without a body the connection stays open for the next request...
        let resp = send(addr, request("GET", "/health", &hdrs(&r), empty())).await;
        assert!(!resp.headers().contains_key("connection"));
        // ...with one, refused unread, the answer says the connection closes, so that
        // a client does not pool it and send its next request into a closed socket.
        let resp = send(
            addr,
            request(
                "POST",
                "/process.Process/Start",
                &hdrs(&r),
                full(b"{}".to_vec()),
            ),
        )
        .await;
        assert_eq!(resp.status(), 502);
        assert_eq!(resp.headers()["connection"], "close");
    }
    // The same for any error answered without reading the body (here the REST side's
    // stand-in, which never reads it), and not for one without a body.
    let resp = send(
        addr,
        request("POST", "/sandboxes", &[], full(b"{}".to_vec())),
    )
    .await;
    assert_eq!(resp.status(), 418);
    assert_eq!(resp.headers()["connection"], "close");
    let resp = send(addr, request("GET", "/sandboxes", &[], empty())).await;
    assert_eq!(resp.status(), 418);
    assert!(!resp.headers().contains_key("connection"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_not_listening_is_port_not_open() {
    let dir = TempDir::new("noenvd");
    std::fs::create_dir_all(dir.path().join("ctl")).unwrap();
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbdown",
        &dir.path().join("ctl/envd.sock"),
        std::process::id(),
        Some("t"),
        None,
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;
    let r = route("sbdown", ENVD);
    let resp = send(addr, request("GET", "/health", &hdrs(&r), empty())).await;
    assert_eq!(resp.status(), 502);
    assert_eq!(
        body_text(resp).await,
        r#"{"sandboxId":"sbdown","message":"The sandbox is running but port is not open","port":49983,"code":502}"#
    );
}

/// The first request to a sandbox goes over the idle connection its create left open
/// (the resolver hands it over) instead of a new one: here envd's socket does not even
/// exist, and the handed-over connection leads to a stand-in that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_over_connection_carries_the_first_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = TempDir::new("handover");
    std::fs::create_dir_all(dir.path().join("ctl")).unwrap();
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    ours.set_nonblocking(true).unwrap();
    theirs.set_nonblocking(true).unwrap();
    let theirs = tokio::net::UnixStream::from_std(theirs).unwrap();
    let served = tokio::spawn(async move {
        let mut theirs = theirs;
        let (mut got, mut buf) = (Vec::new(), [0u8; 1024]);
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = theirs.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before a request");
            got.extend_from_slice(&buf[..n]);
        }
        theirs
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nadopted")
            .await
            .unwrap();
        String::from_utf8_lossy(&got).into_owned()
    });
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbkept",
        &dir.path().join("ctl/envd.sock"),
        std::process::id(),
        Some("t"),
        None,
    ));
    resolver.conns.lock().unwrap().insert("sbkept".into(), ours);
    let addr = start_router(resolver.clone(), RouterConfig::default()).await;
    let r = route("sbkept", ENVD);
    let resp = send(addr, request("GET", "/health", &hdrs(&r), empty())).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(body_text(resp).await, "adopted");
    assert!(served.await.unwrap().starts_with("GET /health "));
    assert!(resolver.conns.lock().unwrap().is_empty(), "taken");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_routes_and_bad_headers_refused() {
    let (envd, _r, addr) = envd_router("tok-int", "sbint").await;
    let r = route("sbint", ENVD);
    for path in [
        "/init",
        "/init/",
        "//init",
        "/%69nit",
        "/freeze",
        "/unfreeze",
        "/fsfreeze",
        "/fsthaw",
        "/collapse",
        "/upgrade",
    ] {
        let mut h = hdrs(&r);
        h.extend([
            ("X-Access-Token", envd.token.as_str()),
            ("Content-Type", "application/json"),
        ]);
        let resp = send(
            addr,
            request("POST", path, &h, full(r#"{"accessToken":"evil"}"#)),
        )
        .await;
        assert_eq!(resp.status(), 403, "{path}");
        let v: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
        assert_eq!(v["code"], 403);
        assert!(v["message"].as_str().unwrap().contains("internal"), "{v}");
    }
    // Protocol upgrades to envd are refused too.
    let mut h = hdrs(&r);
    h.extend([("Connection", "upgrade"), ("Upgrade", "websocket")]);
    let resp = send(addr, request("GET", "/files", &h, empty())).await;
    assert_eq!(resp.status(), 403);
    let v: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert!(v["message"].as_str().unwrap().contains("internal"), "{v}");
    // The token did not change: envd still accepts the original one.
    let mut h = hdrs(&r);
    h.extend([
        ("X-Access-Token", envd.token.as_str()),
        ("Content-Type", "application/json"),
    ]);
    let body = json!({"path": "/"}).to_string();
    let resp = send(
        addr,
        request("POST", "/filesystem.Filesystem/Stat", &h, full(body)),
    )
    .await;
    assert_eq!(resp.status(), 200);

    // Only one routing header → 400 JSON; bad port → 400 JSON.
    let resp = send(
        addr,
        request("GET", "/health", &[("E2b-Sandbox-Id", "sbint")], empty()),
    )
    .await;
    assert_eq!(resp.status(), 400);
    let v: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert_eq!(v["code"], 400);
    let resp = send(
        addr,
        request(
            "GET",
            "/health",
            &[("E2b-Sandbox-Id", "sbint"), ("E2b-Sandbox-Port", "http")],
            empty(),
        ),
    )
    .await;
    assert_eq!(resp.status(), 400);
    // No routing at all: the REST API gets it.
    let resp = send(addr, request("GET", "/health", &[], empty())).await;
    assert_eq!(resp.status(), 418);
}

fn sign(path: &str, op: &str, user: &str, token: &str, exp: Option<i64>) -> String {
    use sha2::{Digest, Sha256};
    let mut raw = format!("{path}:{op}:{user}:{token}");
    if let Some(e) = exp {
        raw.push_str(&format!(":{e}"));
    }
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes()))
    )
}

fn enc(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// Presigned URLs opened without routing headers reach the sandbox whose token signed
/// them: envd re-checks the signature with its own token, so a wrong pick would be a 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presigned_files_without_headers_reach_the_right_sandbox() {
    let a = Envd::start("token-aaaa");
    let b = Envd::start("token-bbbb");
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sba",
        &a.socket,
        std::process::id(),
        Some(&a.token),
        None,
    ));
    resolver.insert(target(
        "sbb",
        &b.socket,
        std::process::id(),
        Some(&b.token),
        None,
    ));
    let ghost = TempDir::new("ghost");
    resolver.insert(target(
        "sbc",
        &ghost.path().join("envd.sock"),
        1,
        Some("token-cccc"),
        None,
    ));
    resolver.insert(target(
        "sbd",
        &ghost.path().join("envd.sock"),
        1,
        None,
        None,
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;

    let dir = b.files_dir();
    let path = format!("{}/up load.txt", dir.display());
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        + 600;
    // A signature over an explicit user (root can only be chosen when the test runs as root:
    // envd chowns the upload to that user).
    let user = if is_root() { "root" } else { "" };
    for (envd, user) in [(&b, ""), (&a, user)] {
        let content = format!("written through {}", envd.token);
        let sig = sign(&path, "write", user, &envd.token, Some(exp));
        let mut url = format!(
            "/files?path={}&signature={}&signature_expiration={exp}",
            enc(&path),
            enc(&sig)
        );
        if !user.is_empty() {
            url.push_str(&format!("&username={user}"));
        }
        let resp = send(
            addr,
            request(
                "POST",
                &url,
                &[("Content-Type", "application/octet-stream")],
                full(content.clone()),
            ),
        )
        .await;
        assert_eq!(resp.status(), 200, "{}", body_text(resp).await);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), content);

        let sig = sign(&path, "read", user, &envd.token, None);
        let mut url = format!("/files?path={}&signature={}", enc(&path), enc(&sig));
        if !user.is_empty() {
            url.push_str(&format!("&username={user}"));
        }
        let resp = send(addr, request("GET", &url, &[], empty())).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(body_text(resp).await, content);
    }
    // curl, as a user would run it on a presigned URL (a 2 MiB POST: curl sends
    // `Expect: 100-continue`).
    if std::process::Command::new("curl")
        .arg("--version")
        .output()
        .is_ok()
    {
        let src = b.files_dir().join("src.bin");
        let data: Vec<u8> = (0..(2u32 << 20)).map(|i| (i % 253) as u8).collect();
        std::fs::write(&src, &data).unwrap();
        let dst = format!("{}/curl dst.bin", dir.display());
        let sig = sign(&dst, "write", "", &b.token, None);
        let url = format!(
            "http://{addr}/files?path={}&signature={}",
            enc(&dst),
            enc(&sig)
        );
        let out = tokio::process::Command::new("curl")
            .args([
                "-sS",
                "-f",
                "-H",
                "Content-Type: application/octet-stream",
                "--data-binary",
            ])
            .arg(format!("@{}", src.display()))
            .arg(&url)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "curl upload: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(std::fs::read(&dst).unwrap(), data);
        let sig = sign(&dst, "read", "", &b.token, None);
        let url = format!(
            "http://{addr}/files?path={}&signature={}",
            enc(&dst),
            enc(&sig)
        );
        let out = tokio::process::Command::new("curl")
            .args(["-sS", "-f"])
            .arg(&url)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "curl download: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.stdout, data);
    } else {
        eprintln!("curl not installed: skipping the curl part of the presigned URL test");
    }
    // A signature no sandbox made: 401 JSON from the router.
    let sig = sign(&path, "read", "", "token-zzzz", None);
    let url = format!("/files?path={}&signature={}", enc(&path), enc(&sig));
    let resp = send(addr, request("GET", &url, &[], empty())).await;
    assert_eq!(resp.status(), 401);
    let v: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert_eq!(v["code"], 401);
    // A read signature does not allow a write.
    let sig = sign(&path, "read", "", &b.token, None);
    let url = format!("/files?path={}&signature={}", enc(&path), enc(&sig));
    let resp = send(
        addr,
        request(
            "POST",
            &url,
            &[("Content-Type", "application/octet-stream")],
            full("x"),
        ),
    )
    .await;
    assert_eq!(resp.status(), 401);
    // An expired signature is routed (it matches sbb) and refused by envd.
    let sig = sign(&path, "read", "", &b.token, Some(1));
    let url = format!(
        "/files?path={}&signature={}&signature_expiration=1",
        enc(&path),
        enc(&sig)
    );
    let resp = send(addr, request("GET", &url, &[], empty())).await;
    assert_eq!(resp.status(), 401);
    let v: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert!(v["message"].as_str().unwrap().contains("expired"), "{v}");
}

// ------------------------------------------------------------------ network namespace

struct NetnsFixture {
    ns: NetnsBox,
    web_port: u16,
    ws_port: u16,
    closed_port: u16,
    dropped: Arc<AtomicUsize>,
}

async fn netns_fixture(test: &str) -> Option<NetnsFixture> {
    let ns = NetnsBox::new(test)?;
    let web = ns.listen();
    let web_port = web.local_addr().unwrap().port();
    let dropped = Arc::new(AtomicUsize::new(0));
    serve_web(web, dropped.clone()).await;
    let ws = ns.listen();
    let ws_port = ws.local_addr().unwrap().port();
    serve_ws_echo(ws).await;
    // A port nobody listens on: bind, note, close.
    let closed_port = ns.listen().local_addr().unwrap().port();
    Some(NetnsFixture {
        ns,
        web_port,
        ws_port,
        closed_port,
        dropped,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_ports_inside_the_netns() {
    let Some(fx) = netns_fixture("user_ports_inside_the_netns").await else {
        return;
    };
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbnet",
        std::path::Path::new("/nonexistent/envd.sock"),
        fx.ns.pid,
        Some("t"),
        None,
    ));
    let config = RouterConfig {
        domain: Some("sb.test".into()),
        ..Default::default()
    };
    let addr = start_router(resolver, config).await;
    let r = route("sbnet", fx.web_port);

    let resp = send(addr, request("GET", "/hello", &hdrs(&r), empty())).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(body_text(resp).await, "hello from the sandbox");

    // Host routing: <port>-<id>.<domain>.
    let host = format!("{}-sbnet.sb.test:3000", fx.web_port);
    let req = hyper::Request::builder()
        .uri("/hello")
        .header("host", &host)
        .body(empty())
        .unwrap();
    let resp = send(addr, req).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(body_text(resp).await, "hello from the sandbox");

    // Headers: end-to-end ones pass, hop-by-hop ones do not.
    let mut h = hdrs(&r);
    h.extend([
        ("X-Custom", "yes"),
        ("Connection", "keep-alive, x-private"),
        ("X-Private", "no"),
        ("TE", "trailers"),
    ]);
    let resp = send(addr, request("GET", "/headers", &h, empty())).await;
    let v: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert_eq!(v["x-custom"], "yes", "{v}");
    assert_eq!(v["e2b-sandbox-id"], "sbnet", "{v}");
    assert_eq!(v["host"], "127.0.0.1", "{v}");
    assert!(v.get("x-private").is_none() && v.get("te").is_none(), "{v}");

    // A chunked 8 MiB body streamed to the sandbox and back.
    let chunk = Bytes::from((0..65536u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
    let body = chunked(vec![chunk.clone(); 128]);
    let resp = send(addr, request("POST", "/echo", &hdrs(&r), body)).await;
    assert_eq!(resp.status(), 200);
    let got = body_bytes(resp).await;
    assert_eq!(got.len(), 8 << 20);
    assert!(got.chunks(65536).all(|c| c == &chunk[..]));

    // Closed port: the exact 502.
    let r = route("sbnet", fx.closed_port);
    let resp = send(addr, request("GET", "/", &hdrs(&r), empty())).await;
    assert_eq!(resp.status(), 502);
    assert_eq!(
        body_text(resp).await,
        format!(
            r#"{{"sandboxId":"sbnet","message":"The sandbox is running but port is not open","port":{},"code":502}}"#,
            fx.closed_port
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_token_enforced_on_user_ports_only() {
    let Some(fx) = netns_fixture("traffic_token_enforced_on_user_ports_only").await else {
        return;
    };
    let envd = Envd::start("tok-traffic");
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbtt",
        &envd.socket,
        fx.ns.pid,
        Some(&envd.token),
        Some("traffic-secret"),
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;
    let r = route("sbtt", fx.web_port);

    let resp = send(addr, request("GET", "/hello", &hdrs(&r), empty())).await;
    assert_eq!(resp.status(), 401);
    let v: Value = serde_json::from_slice(&body_bytes(resp).await).unwrap();
    assert_eq!(v["code"], 401);
    let mut h = hdrs(&r);
    h.push(("E2B-Traffic-Access-Token", "wrong"));
    let resp = send(addr, request("GET", "/hello", &h, empty())).await;
    assert_eq!(resp.status(), 403);
    let mut h = hdrs(&r);
    h.push(("e2b-traffic-access-token", "traffic-secret"));
    let resp = send(addr, request("GET", "/hello", &h, empty())).await;
    assert_eq!(resp.status(), 200);
    // envd's port never needs it.
    let r = route("sbtt", ENVD);
    let resp = send(addr, request("GET", "/health", &hdrs(&r), empty())).await;
    assert_eq!(resp.status(), 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_echo_through_the_router() {
    use tokio::io::AsyncWriteExt;
    let Some(fx) = netns_fixture("websocket_echo_through_the_router").await else {
        return;
    };
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbws",
        std::path::Path::new("/nonexistent"),
        fx.ns.pid,
        None,
        None,
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;
    let key = "dGhlIHNhbXBsZSBub25jZQ==";
    let r = route("sbws", fx.ws_port);
    let mut h = hdrs(&r);
    h.extend([
        ("Connection", "Upgrade"),
        ("Upgrade", "websocket"),
        ("Sec-WebSocket-Key", key),
        ("Sec-WebSocket-Version", "13"),
    ]);
    let mut resp = send(addr, request("GET", "/ws", &h, empty())).await;
    assert_eq!(resp.status(), 101);
    assert_eq!(
        resp.headers()["sec-websocket-accept"],
        ws_accept(key).as_str()
    );
    assert!(
        resp.headers()["upgrade"]
            .to_str()
            .unwrap()
            .eq_ignore_ascii_case("websocket")
    );
    let upgraded = hyper::upgrade::on(&mut resp).await.unwrap();
    let mut io = hyper_util::rt::TokioIo::new(upgraded);
    for msg in [&b"hello websocket"[..], &vec![7u8; 100_000][..]] {
        io.write_all(&ws_frame(0x2, msg, Some([1, 2, 3, 4])))
            .await
            .unwrap();
        let (op, payload) = ws_read_frame(&mut io).await.unwrap();
        assert_eq!(op, 0x2);
        assert_eq!(payload, msg);
    }
    io.write_all(&ws_frame(0x8, b"", Some([9, 9, 9, 9])))
        .await
        .unwrap();
    let (op, _) = ws_read_frame(&mut io).await.unwrap();
    assert_eq!(op, 0x8);
}

/// A client that goes away mid-stream closes the upstream connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_drops_the_upstream_stream() {
    let Some(fx) = netns_fixture("client_disconnect_drops_the_upstream_stream").await else {
        return;
    };
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbdc",
        std::path::Path::new("/nonexistent"),
        fx.ns.pid,
        None,
        None,
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;
    let r = route("sbdc", fx.web_port);
    for round in 1..=3 {
        let resp = send(addr, request("GET", "/endless", &hdrs(&r), empty())).await;
        let mut body = resp.into_body();
        let mut got = 0;
        while got < 50 {
            got += body
                .frame()
                .await
                .unwrap()
                .unwrap()
                .into_data()
                .map_or(0, |d| d.len());
        }
        drop(body); // closes our connection to the router
        let deadline = Instant::now() + Duration::from_secs(5);
        while fx.dropped.load(Ordering::SeqCst) < round {
            assert!(
                Instant::now() < deadline,
                "upstream stream still running after client left"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A sandbox whose init is gone answers "not found" on user ports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_init_is_not_found() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbdead",
        std::path::Path::new("/nonexistent"),
        pid,
        None,
        None,
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;
    let r = route("sbdead", 8000);
    let resp = send(addr, request("GET", "/", &hdrs(&r), empty())).await;
    assert_eq!(resp.status(), 502);
    assert_eq!(
        body_text(resp).await,
        r#"{"sandboxId":"sbdead","message":"The sandbox was not found","code":502}"#
    );
}

/// The attack: a sandbox's init died, the router still has its target, and the init's
/// pid now belongs to another process with its own network namespace and a server on
/// the asked port (another sandbox, or any local process). Entering `/proc/<pid>/ns/net`
/// would reach that process; through the dead init's pidfd the router finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reused_init_pid_leads_nowhere() {
    if !is_root() {
        eprintln!("skipping reused_init_pid_leads_nowhere: needs root");
        return;
    }
    // The "sandbox": a process whose pidfd the resolver hands out, then dies.
    let mut init = std::process::Command::new("sleep")
        .arg("1000")
        .spawn()
        .unwrap();
    let pid = init.id();
    let dead = target(
        "sbreuse",
        std::path::Path::new("/nonexistent"),
        pid,
        None,
        None,
    );
    assert!(dead.init_pidfd.is_some());
    init.kill().unwrap();
    init.wait().unwrap();
    // Its pid, now another network namespace with a web server.
    let other = NetnsBox::with_pid("reused_init_pid_leads_nowhere", pid)
        .expect("could not get the freed pid reused (too many forks on this host?)");
    assert_eq!(other.pid, pid, "the pid is reused");
    let web = other.listen();
    let port = web.local_addr().unwrap().port();
    serve_web(web, Arc::new(AtomicUsize::new(0))).await;

    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(dead);
    // Control: the same server is reachable for a target that really is that process.
    resolver.insert(target(
        "sbother",
        std::path::Path::new("/nonexistent"),
        other.pid,
        None,
        None,
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;
    let resp = send(
        addr,
        request("GET", "/hello", &hdrs(&route("sbother", port)), empty()),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let resp = send(
        addr,
        request("GET", "/hello", &hdrs(&route("sbreuse", port)), empty()),
    )
    .await;
    assert_eq!(resp.status(), 502);
    assert_eq!(
        body_text(resp).await,
        r#"{"sandboxId":"sbreuse","message":"The sandbox was not found","code":502}"#
    );
}

/// A client that leaves before the sandbox answered: the upstream connection is closed
/// too (watched in the namespace's own TCP table), not left waiting for the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_before_response_closes_upstream() {
    let Some(fx) = netns_fixture("client_gone_before_response_closes_upstream").await else {
        return;
    };
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbslow",
        std::path::Path::new("/nonexistent"),
        fx.ns.pid,
        None,
        None,
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;
    let r = route("sbslow", fx.web_port);
    let pending =
        tokio::spawn(async move { send(addr, request("GET", "/slow", &hdrs(&r), empty())).await });
    let deadline = Instant::now() + Duration::from_secs(5);
    while established_on(fx.ns.pid, fx.web_port) == 0 {
        assert!(
            Instant::now() < deadline,
            "request never reached the sandbox"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // While the client waits, the upstream request stays open.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(established_on(fx.ns.pid, fx.web_port), 1);
    pending.abort(); // drops the client connection
    let deadline = Instant::now() + Duration::from_secs(5);
    while established_on(fx.ns.pid, fx.web_port) != 0 {
        assert!(
            Instant::now() < deadline,
            "upstream connection still open after the client left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Many concurrent streams and unary calls share the pooled upstream connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams() {
    let (envd, _r, addr) = envd_router("tok-many", "sbmany").await;
    let mut tasks = Vec::new();
    for i in 0..40 {
        let token = envd.token.clone();
        tasks.push(tokio::spawn(async move {
            let resp = send(addr, start_request("sbmany", &token, &format!("echo n{i}"))).await;
            assert_eq!(resp.status(), 200);
            let events = parse_envelopes(&body_bytes(resp).await);
            assert_eq!(stdout_of(&events), format!("n{i}\n"));
            let r = route("sbmany", ENVD);
            let resp = send(addr, request("GET", "/health", &hdrs(&r), empty())).await;
            assert_eq!(resp.status(), 204);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}
