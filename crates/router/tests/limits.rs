//! What one client cannot do to `cubicle serve`'s front door and data plane: hold more
//! connections than its share, keep connections with a request head that never
//! completes (slowloris) or an idle keep-alive, keep an unused WebSocket tunnel to a
//! sandbox open forever. Each test performs the attack and checks it is cut short.

// Tests: a failed unwrap or expect is a failed test (clippy.toml allows them only in #[test] fns).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use common::*;
use cubicle_router::{RouterConfig, ServerLimits};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// Reads until the peer closes (Ok(bytes)) or `within` passes (Err).
async fn read_until_closed(s: &mut TcpStream, within: Duration) -> Result<Vec<u8>, Vec<u8>> {
    let mut got = Vec::new();
    let r = tokio::time::timeout(within, async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    match r {
        Ok(()) => Ok(got),
        Err(_) => Err(got),
    }
}

/// One client opens connections and holds them: past its share it is answered 429 in
/// E2B's error shape and disconnected; once it closes some, it gets served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_per_client_are_limited() {
    let limits = ServerLimits {
        max_connections_per_client: 4,
        ..Default::default()
    };
    let addr = start_router_with_limits(
        Arc::new(FakeResolver::default()),
        RouterConfig::default(),
        limits,
    )
    .await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    // Accepted and counted: the server has seen them once a request on a fifth
    // connection is refused.
    let mut extra = TcpStream::connect(addr).await.unwrap();
    extra
        .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until_closed(&mut extra, Duration::from_secs(5))
        .await
        .expect("the connection over the limit is closed");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 429 "), "{text}");
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["code"], 429, "{v}");
    assert!(v["message"].as_str().unwrap().contains("127.0.0.1"), "{v}");

    // The held connections still work.
    let s = &mut held[0];
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 418"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );

    // Closing two frees two places.
    held.truncate(2);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut again = TcpStream::connect(addr).await.unwrap();
        again
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let got = read_until_closed(&mut again, Duration::from_secs(5))
            .await
            .unwrap_or_default();
        if got.starts_with(b"HTTP/1.1 418") {
            break;
        }
        assert!(Instant::now() < deadline, "places were not freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Slowloris: a request head trickling in one byte at a time, and a kept-alive
/// connection that never sends its next request, are both closed after the
/// header-read timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_or_idle_request_heads_are_cut_off() {
    let limits = ServerLimits {
        header_read_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let addr = start_router_with_limits(
        Arc::new(FakeResolver::default()),
        RouterConfig::default(),
        limits,
    )
    .await;

    // Trickle: one header byte every 200 ms, forever.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    let t = Instant::now();
    let trickle = async {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if slow.write_all(b"x").await.is_err() {
                return;
            }
            let mut buf = [0u8; 256];
            match tokio::time::timeout(Duration::from_millis(1), slow.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return,
                _ => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), trickle)
        .await
        .expect("a trickling request head must be cut off");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());

    // Idle keep-alive: one request, then silence.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let t = Instant::now();
    let got = read_until_closed(&mut idle, Duration::from_secs(10))
        .await
        .expect("an idle kept-alive connection must be closed");
    assert!(got.starts_with(b"HTTP/1.1 418"));
    assert!(
        t.elapsed() >= Duration::from_millis(900) && t.elapsed() < Duration::from_secs(4),
        "{:?}",
        t.elapsed()
    );
}

/// A WebSocket tunnel to a user port that nobody uses is closed after the idle timeout,
/// on both sides (the upstream connection inside the sandbox too); one in use is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_websocket_tunnels_are_closed() {
    let Some(ns) = NetnsBox::new("idle_websocket_tunnels_are_closed") else {
        return;
    };
    let ws = ns.listen();
    let ws_port = ws.local_addr().unwrap().port();
    serve_ws_echo(ws).await;
    let resolver = Arc::new(FakeResolver::default());
    resolver.insert(target(
        "sbidle",
        std::path::Path::new("/nonexistent"),
        ns.pid,
        None,
        None,
    ));
    let config = RouterConfig {
        tunnel_idle_timeout: Duration::from_secs(1),
        ..Default::default()
    };
    let addr = start_router(resolver, config).await;
    let r = route("sbidle", ws_port);
    let mut h = hdrs(&r);
    h.extend([
        ("Connection", "Upgrade"),
        ("Upgrade", "websocket"),
        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ("Sec-WebSocket-Version", "13"),
    ]);
    let mut resp = send(addr, request("GET", "/ws", &h, empty())).await;
    assert_eq!(resp.status(), 101);
    let upgraded = hyper::upgrade::on(&mut resp).await.unwrap();
    let mut io = hyper_util::rt::TokioIo::new(upgraded);
    // In use for 3 s (three idle timeouts): stays open.
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(3) {
        io.write_all(&ws_frame(0x1, b"still here", Some([1, 2, 3, 4])))
            .await
            .unwrap();
        let (op, payload) = ws_read_frame(&mut io).await.unwrap();
        assert_eq!((op, &payload[..]), (0x1, &b"still here"[..]));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(established_on(ns.pid, ws_port), 1);
    // Then silence: the router closes the tunnel.
    let t = Instant::now();
    let mut buf = [0u8; 64];
    let r = tokio::time::timeout(Duration::from_secs(10), io.read(&mut buf))
        .await
        .expect("an idle tunnel must be closed");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    let deadline = Instant::now() + Duration::from_secs(5);
    while established_on(ns.pid, ws_port) > 0 {
        assert!(
            Instant::now() < deadline,
            "the upstream connection stayed open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
