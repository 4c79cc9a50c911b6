//! A minimal Connect (JSON) client for integration tests: serves envd's router on
//! 127.0.0.1:0 in-process and speaks raw HTTP/1.1 to it with hyper.

#![allow(dead_code)]

use std::{convert::Infallible, net::SocketAddr, sync::Arc, time::Duration};

use base64::Engine;
use bytes::Bytes;
use cubicle_envd::{
    server::{self, AppState},
    state::{Config, Context},
};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::{Request, body::Frame};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::{net::TcpStream, sync::mpsc, task::JoinHandle};

pub struct Envd {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
}

/// Starts envd (development mode, acting user = the test's user) on a free port.
pub async fn serve() -> Envd {
    let ctx = Arc::new(Context::new(Config {
        dev: true,
        default_user: None,
        default_workdir: None,
        access_token: None,
    }));
    let state = AppState::new(ctx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = server::router(state.clone());
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Envd { addr, state }
}

pub type Body = BoxBody<Bytes, Infallible>;

pub use cubicle_proto::connect::envelope;

pub fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

pub fn unb64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

/// A response whose body is read envelope by envelope.
pub struct StreamResp {
    pub status: u16,
    pub content_type: String,
    body: hyper::body::Incoming,
    decoder: cubicle_proto::connect::EnvelopeDecoder,
    conn: JoinHandle<()>,
}

impl StreamResp {
    /// The next envelope: `(flags, json)`; `None` at the end of the body.
    pub async fn next(&mut self) -> Option<(u8, Value)> {
        loop {
            if let Some(e) = self.decoder.next_envelope().unwrap() {
                return Some((e.flags, serde_json::from_slice(&e.payload).unwrap()));
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.decoder.push(&d);
                    }
                }
                _ => return None,
            }
        }
    }

    /// The next data message's `event` (panics at end-of-stream).
    pub async fn event(&mut self) -> Value {
        let (flags, v) = self.next().await.expect("stream ended");
        assert_eq!(flags, 0, "expected a data envelope, got end-of-stream {v}");
        v["event"].clone()
    }

    /// Reads events until `end`, skipping keepalives; returns (stdout, stderr, pty, end).
    pub async fn collect(&mut self) -> Collected {
        let mut c = Collected::default();
        loop {
            let (flags, v) = self
                .next()
                .await
                .expect("stream ended before end-of-stream");
            if flags == 2 {
                c.trailer = Some(v);
                return c;
            }
            let ev = &v["event"];
            if let Some(d) = ev.get("data") {
                for (k, out) in [
                    ("stdout", &mut c.stdout),
                    ("stderr", &mut c.stderr),
                    ("pty", &mut c.pty),
                ] {
                    if let Some(s) = d.get(k).and_then(Value::as_str) {
                        out.extend_from_slice(&unb64(s));
                    }
                }
            } else if let Some(e) = ev.get("end") {
                assert!(c.end.is_none(), "two end events");
                c.end = Some(e.clone());
            } else if ev.get("keepalive").is_some() {
                c.keepalives += 1;
            } else if ev.get("start").is_some() {
                panic!("start event after the first message: {v}");
            }
            c.events += 1;
        }
    }

    /// Drops the connection (a client that goes away).
    pub fn disconnect(self) {
        self.conn.abort();
    }
}

#[derive(Debug, Default)]
pub struct Collected {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub pty: Vec<u8>,
    pub end: Option<Value>,
    pub trailer: Option<Value>,
    pub keepalives: usize,
    pub events: usize,
}

impl Collected {
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

async fn send(
    addr: SocketAddr,
    path: &str,
    ct: &str,
    headers: &[(&str, &str)],
    body: Body,
) -> StreamResp {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::post(path)
        .header("host", "localhost")
        .header("connect-protocol-version", "1");
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        req = req.header("content-type", ct);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = sender.send_request(req.body(body).unwrap()).await.unwrap();
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    StreamResp {
        status,
        content_type,
        body: resp.into_body(),
        decoder: cubicle_proto::connect::EnvelopeDecoder::new(64 << 20),
        conn,
    }
}

/// Opens a server-stream call with one request message.
pub async fn stream(envd: &Envd, method: &str, msg: Value, headers: &[(&str, &str)]) -> StreamResp {
    stream_raw(envd, method, msg.to_string().as_bytes(), headers).await
}

/// Like [`stream`], with raw payload bytes.
pub async fn stream_raw(
    envd: &Envd,
    method: &str,
    payload: &[u8],
    headers: &[(&str, &str)],
) -> StreamResp {
    let body = Full::new(envelope(0, payload)).boxed();
    let r = send(
        envd.addr,
        &format!("/process.Process/{method}"),
        "application/connect+json",
        headers,
        body,
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.content_type, "application/connect+json");
    r
}

/// A unary call: (status, json body).
pub async fn unary(envd: &Envd, method: &str, msg: Value) -> (u16, Value) {
    unary_raw(envd, method, msg.to_string().as_bytes(), &[]).await
}

pub async fn unary_raw(
    envd: &Envd,
    method: &str,
    payload: &[u8],
    headers: &[(&str, &str)],
) -> (u16, Value) {
    let body = Full::new(Bytes::copy_from_slice(payload)).boxed();
    let mut r = send(
        envd.addr,
        &format!("/process.Process/{method}"),
        "application/json",
        headers,
        body,
    )
    .await;
    let mut bytes = Vec::new();
    while let Some(Ok(f)) = r.body.frame().await {
        if let Ok(d) = f.into_data() {
            bytes.extend_from_slice(&d);
        }
    }
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    (r.status, v)
}

/// A client-stream call whose messages are fed through the returned sender.
pub async fn client_stream(
    envd: &Envd,
    method: &str,
) -> (mpsc::Sender<Value>, JoinHandle<StreamResp>) {
    let (tx, mut rx) = mpsc::channel::<Value>(16);
    let (ftx, frx) = mpsc::channel::<Result<Frame<Bytes>, Infallible>>(16);
    tokio::spawn(async move {
        while let Some(v) = rx.recv().await {
            if ftx
                .send(Ok(Frame::data(envelope(0, v.to_string().as_bytes()))))
                .await
                .is_err()
            {
                return;
            }
        }
        let _ = ftx.send(Ok(Frame::data(envelope(2, b"{}")))).await;
    });
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(frx)).boxed();
    let addr = envd.addr;
    let path = format!("/process.Process/{method}");
    let h =
        tokio::spawn(async move { send(addr, &path, "application/connect+json", &[], body).await });
    (tx, h)
}

/// Starts a command and returns the open stream and its pid.
pub async fn start(envd: &Envd, req: Value, headers: &[(&str, &str)]) -> (StreamResp, u32) {
    let mut s = stream(envd, "Start", req, headers).await;
    let first = s.event().await;
    let pid = first["start"]["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("first event is not start: {first}"));
    (s, pid as u32)
}

pub fn sh(cmd: &str) -> Value {
    json!({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}, "stdin": false})
}

/// Whether a pid is alive (not gone, not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => {
            let state = s[s.rfind(')').unwrap() + 2..].chars().next().unwrap();
            state != 'Z' && state != 'X'
        }
        Err(_) => false,
    }
}

/// Polls `f` until it holds or `timeout` passes.
pub async fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let until = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < until {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}
