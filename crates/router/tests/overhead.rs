//! Per-request overhead of the router versus talking to envd's socket directly. Ignored by
//! default (a measurement, not a check); run with
//! `cargo test --release -p cubicle-router --test overhead -- --ignored --nocapture`.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use common::*;
use cubicle_router::RouterConfig;
use http_body_util::BodyExt;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::json;

async fn keepalive<IO>(io: IO) -> SendRequest<TestBody>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
}

async fn call(s: &mut SendRequest<TestBody>, req: hyper::Request<TestBody>, expect: u16) -> Bytes {
    s.ready().await.unwrap();
    let resp = s.send_request(req).await.unwrap();
    assert_eq!(resp.status(), expect);
    resp.into_body().collect().await.unwrap().to_bytes()
}

fn stats(name: &str, mut v: Vec<Duration>) -> Duration {
    v.sort();
    let mean = v.iter().sum::<Duration>() / v.len() as u32;
    let p50 = v[v.len() / 2];
    let p99 = v[v.len() * 99 / 100];
    eprintln!(
        "{name:<34} n={:<5} mean {:>8.1} µs  p50 {:>8.1} µs  p99 {:>8.1} µs",
        v.len(),
        mean.as_secs_f64() * 1e6,
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6
    );
    p50
}

fn health(route: &[(String, String)]) -> hyper::Request<TestBody> {
    request("GET", "/health", &hdrs(route), empty())
}

fn start_true(route: &[(String, String)], token: &str) -> hyper::Request<TestBody> {
    let msg = json!({"process": {"cmd": "/bin/true"}});
    let mut h = hdrs(route);
    h.extend([
        ("X-Access-Token", token),
        ("Content-Type", "application/connect+json"),
        ("Connect-Protocol-Version", "1"),
    ]);
    request(
        "POST",
        "/process.Process/Start",
        &h,
        full(envelope(0, msg.to_string().as_bytes())),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run with --ignored --nocapture"]
async fn router_overhead() {
    let envd = Envd::start("tok-bench");
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbbench",
        &envd.socket,
        std::process::id(),
        Some(&envd.token),
        None,
    ));
    let addr = start_router(resolver, RouterConfig::default()).await;
    let r = route("sbbench", 49983);

    let mut direct = keepalive(tokio::net::UnixStream::connect(&envd.socket).await.unwrap()).await;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.set_nodelay(true).unwrap();
    let mut routed = keepalive(tcp).await;

    for (n, label) in [(3000usize, "GET /health"), (400, "Process.Start /bin/true")] {
        // Interleave direct and routed calls so drift affects both alike.
        let (mut d, mut v) = (Vec::new(), Vec::new());
        for i in 0..n + 50 {
            let (req_d, req_r, expect) = if label.starts_with("GET") {
                (health(&[]), health(&r), 204)
            } else {
                (
                    start_true(&[], &envd.token),
                    start_true(&r, &envd.token),
                    200,
                )
            };
            let t = Instant::now();
            call(&mut direct, req_d, expect).await;
            let td = t.elapsed();
            let t = Instant::now();
            call(&mut routed, req_r, expect).await;
            let tr = t.elapsed();
            if i >= 50 {
                d.push(td);
                v.push(tr);
            }
        }
        let pd = stats(&format!("{label} direct (unix)"), d);
        let pr = stats(&format!("{label} via router (tcp)"), v);
        eprintln!(
            "{label}: router overhead p50 {:.1} µs",
            (pr.as_secs_f64() - pd.as_secs_f64()) * 1e6
        );
    }

    // A fresh client connection per request (what a client without keep-alive pays).
    let mut v = Vec::new();
    for _ in 0..1000 {
        let t = Instant::now();
        let resp = send(addr, health(&r)).await;
        assert_eq!(resp.status(), 204);
        v.push(t.elapsed());
    }
    stats("GET /health, new client conn each", v);
}
